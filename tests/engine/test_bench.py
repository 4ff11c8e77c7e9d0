"""`sluiceway bench throughput` end to end on the CPU with a tiny model: the JSON it writes."""

from __future__ import annotations

import json

from click.testing import CliRunner

from engine.bench import bench_command
from engine.tiny import build_tiny_model


def test_throughput_json_counts_every_token_and_names_the_slowest_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # absent: the compile count is unknown
    model = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench_command, [
        "throughput", "--model", str(model), "-n", "6", "--input-len", "12", "--output-len", "5",
        "--max-num-seqs", "4", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    run = json.loads(out.read_text())["engine"]
    assert run["output_tokens"] == 6 * 5 and run["input_tokens"] == 6 * 12
    slowest = run["steps"]["slowest_steps"]
    assert 1 <= len(slowest) <= 5
    assert [s[0] for s in slowest] == sorted((s[0] for s in slowest), reverse=True)
    assert all(1 <= seqs <= 4 and tokens >= seqs for _, seqs, tokens in slowest)
    assert run["kernels_compiled_in_run"] is None

    (tmp_path / "triton").mkdir()  # readable (and unchanged by a CPU run): nothing compiled inside the timing
    result = CliRunner().invoke(bench_command, [
        "throughput", "--model", str(model), "-n", "2", "--input-len", "4", "--output-len", "2", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["engine"]["kernels_compiled_in_run"] == 0
