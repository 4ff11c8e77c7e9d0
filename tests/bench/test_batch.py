"""``sluiceway bench batch`` on CPU: both modes end to end, small (the instant engine; the tiny model)."""

from __future__ import annotations

from bench.batch import instant, real
from tests.worker.conftest import tiny_model  # noqa: F401  (the session's tiny model)


def test_the_instant_mode_reports_memory_over_a_whole_batch(tmp_path):
    report = instant(rows=300, max_outstanding=50, sample_s=0.2, appendonly=False, files_dir=str(tmp_path))
    assert report["completed"] == 300 and report["rows_per_s"] > 0
    memory = report["memory"]
    assert 0 < memory["gateway_rss_mib"]["first"] <= memory["gateway_rss_mib"]["peak"]
    assert report["samples"][-1]["completed"] == 300
    assert list(tmp_path.iterdir())  # the output file left Redis for the directory


def test_the_real_mode_compares_a_batch_with_offline_runs(tiny_model):  # noqa: F811
    from engine import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model=str(tiny_model), device="cpu", max_num_seqs=8, swap_space=0.01))
    try:
        report = real(engine, str(tiny_model), n=8, input_len=8, output_len=3, seed=0, sample_s=0.2,
                      appendonly=False)
    finally:
        engine.shutdown()
    assert report["batch"]["completed"] == 8 and report["batch_over_offline"] > 0
    assert report["offline"]["output_tokens"] == report["offline_after"]["output_tokens"] == 8 * 3
