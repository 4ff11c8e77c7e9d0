"""The demo command and the bulk soak, on the tiny model.

The worker benchmark's test is tests/bench/test_worker.py.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from worker.demo import demo_command


pytestmark = pytest.mark.usefixtures("restore_logging")


def test_the_demo_runs_jobs_through_a_private_redis(tiny_model):
    result = CliRunner().invoke(demo_command, ["--cache-dir", str(tiny_model), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "redis:  redis://127.0.0.1:" in result.output
    assert result.output.count("output 0:") == 4 and "output 1:" in result.output  # n=2 on one job
    assert "celery task" in result.output and "-> SUCCESS" in result.output  # Celery on its Redis, by default
    assert "metadata {'row': 17}" in result.output
    assert "worker stopped cleanly" in result.output


def test_the_bulk_soak_survives_an_interrupted_cli_and_a_killed_worker(tiny_model, tmp_path):
    """``scripts/bulk_soak.py`` at 600 rows, 300 outstanding: SIGINT to the CLI at 30% (rows it
    never submitted left for the restarted CLI), SIGKILL to the worker at 60%, then every promise
    checked from OUT and Redis (the script exits 1 if one fails).

    NOTE: 1,500 rows with 1,000 outstanding left 50 rows unsubmitted at the interrupt and took
    45 s beside the suite's other process; 600 with 300 leave about 120 in less than half
    the rows."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bulk_soak.py"
    report = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(script), "--rows", "600", "--max-outstanding", "300", "--model",
                          str(tiny_model), "--device", "cpu",
                          "--workdir", str(tmp_path / "work"), "--json", str(report), "--timeout", "240"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["ok"] and result["checks"]["one line per row, in order"]["lines"] == 600
    assert [e["what"] for e in result["events"]][:3] == [
        "bulk CLI interrupted (SIGINT)", "bulk CLI restarted", "worker killed (SIGKILL)"]
    assert result["events"][0]["returncode"] == 130  # it stopped on the interrupt, not at the end
