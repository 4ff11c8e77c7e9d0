"""``sluiceway bench gateway`` on CPU: its latency mode and its load path, on the instant engine."""

from __future__ import annotations

from bench.gateway import run_latency, run_streams, through_gateway
from bench.instant_engine import InstantEngine


def test_latency_mode_reports_what_the_gateway_adds():
    report = run_latency(requests=10, input_len=8, max_tokens=4, seed=0)
    for name in ("direct", "gateway", "gateway_stream"):
        assert report[name]["n"] == 10 and 0 < report[name]["p50_ms"] <= report[name]["p99_ms"]
    assert set(report["gateway_added"]) == {"p50_ms", "p99_ms"}


def test_the_load_path_answers_every_request_streamed_through_two_gateway_processes():
    prompts = [[10 + i, 11, 12] for i in range(24)]
    rates = through_gateway(InstantEngine(max_num_seqs=8, tokens_per_step=2), "instant", prompts, output_len=6,
                            concurrency=24, stream=True, processes=2)
    assert rates["requests"] == 24 and rates["output_tokens"] == 24 * 6
    assert rates["time_to_first_chunk"]["n"] == 24


def test_streams_mode_reports_the_gateways_reads_and_cpu_per_streamed_token():
    report = run_streams(n=16, output_len=16, concurrency=16, max_num_seqs=8, processes=1, step_ms=10)
    through = report["gateway"]
    assert through["requests"] == 16 and through["output_tokens"] == 16 * 16
    # one token a step, a step every 10 ms: a read per stream per token entry would be about
    # 16 x 16; the gateway's one shared XREAD reads every stream of a step at once
    assert 0 < through["redis_calls"]["xread"] < 16 * 16 / 2
    assert set(through["cpu_seconds"]) >= {"load", "worker", "redis", "gateway"}
    assert through["gateway_tokens_per_cpu_s"] > 0


def test_the_load_is_spread_over_processes_released_together_and_the_report_carries_the_ramp():
    prompts = [[10 + i, 11, 12] for i in range(30)]
    rates = through_gateway(InstantEngine(max_num_seqs=8, tokens_per_step=2), "instant", prompts, output_len=4,
                            concurrency=30, stream=False, load_processes=3)
    assert rates["requests"] == 30 and rates["output_tokens"] == 30 * 4 and rates["load_processes"] == 3
    # the processes start on one signal once all are ready (their imports are done before it)
    assert 0 <= rates["load_start_spread_s"] < 0.25
    assert 0 < rates["sent_p50_s"] <= rates["ramp_s"] < rates["seconds"]
    arrivals = rates["arrivals"]  # the gateway's view, from the job hashes it submitted
    assert arrivals["jobs"] == 30
    assert arrivals["first_enqueued_s"] <= arrivals["half_enqueued_s"] <= arrivals["last_enqueued_s"] < rates["seconds"]
    assert rates["load_cpu_s"] > 0


def test_the_merged_load_report_runs_from_the_earliest_start_to_the_last_answer():
    from bench.gateway_load import merge

    def report(started, ended, sent, latencies):
        return {"started_at": 1000.0 + started, "started": started, "ended": ended, "seconds": ended - started,
                "cpu_s": 0.5, "latencies": latencies, "first_chunk": [], "sent": sent, "errors": [],
                "completion_tokens": 10 * len(latencies), "answered": len(latencies)}

    merged = merge([report(5.0, 9.0, [5.5, 6.0], [3.0, 3.5]), report(5.1, 12.0, [5.2, 7.0, 5.3], [1, 2, 6.5])])
    assert merged["seconds"] == 7.0 and merged["started_at"] == 1005.0 and merged["processes"] == 2
    assert merged["ramp_s"] == 2.0 and merged["sent_p50_s"] == 0.5 and merged["start_spread_s"] == 0.1
    assert sorted(merged["latencies"]) == [1, 2, 3.0, 3.5, 6.5] and merged["answered"] == 5
    assert merged["completion_tokens"] == 50 and merged["cpu_s"] == 1.0
