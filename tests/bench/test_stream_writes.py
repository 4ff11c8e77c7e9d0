"""``sluiceway bench stream-writes`` on CPU: the worker's writes of streamed tokens, counted."""

from __future__ import annotations

from bench.stream_writes import LOOP_THREAD, run_stream_writes


def test_stream_writes_reports_the_cost_per_token_and_a_step_of_every_job_is_one_script_call():
    report = run_stream_writes(jobs=16, output_len=24, max_num_seqs=16, step_ms=5)
    assert report["tokens"] == 16 * 24 and report["worker_cpu_us_per_token"] > 0
    assert set(report["thread_cpu_us_per_token"]) == {LOOP_THREAD, "sluiceway-writer"}
    # a start and an end per job and one APPEND per step: (2 x 16 + 24) / 384 tokens, about 0.15;
    # a script call per job per step was about one a token
    assert 0 < report["evalsha_per_token"] < 0.3, report["redis_calls"]
    assert report["redis_calls"]["xadd"] > 0 and report["redis_cpu_us_per_token"] > 0
