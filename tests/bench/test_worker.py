"""`sluiceway bench worker` on the tiny model: offline against through Redis and the worker."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench.worker import worker_command


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from engine.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("bench-worker-tiny") / "model", arch="llama")


pytestmark = pytest.mark.usefixtures("restore_logging")


def test_the_bench_reports_the_ratio_as_json(tiny_model, tmp_path):
    out = tmp_path / "bench.json"
    args = ["--model", str(tiny_model), "--load-format", "auto", "--device", "cpu", "--max-num-seqs", "8",
            "--num-requests", "16", "--input-len", "8", "--output-len", "8", "--short-requests", "24",
            "--short-input-len", "4", "--short-output-len", "2", "--no-appendonly", "--json", str(out)]
    result = CliRunner().invoke(worker_command, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    for name, n, tokens in (("throughput", 16, 16 * 8), ("short", 24, 24 * 2)):
        r = report[name]
        assert r["offline"]["output_tokens"] == r["worker"]["output_tokens"] == tokens
        assert r["worker"]["requests"] == n and r["e2e_over_offline"] > 0 and r["jobs_per_s"] > 0
    assert "e2e/offline" in result.output
