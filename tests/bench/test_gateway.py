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
