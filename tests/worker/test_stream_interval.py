"""Token deltas of one writer round go out as one entry per completion; ``stream_interval_ms``
spaces the rounds of a streamed job, so its tokens take fewer, larger entries."""

from __future__ import annotations

import redis

from bench.instant_engine import InstantEngine
from producers.client import Client
from producers.protocol import Keys, TokenDelta
from tests.worker.conftest import RunningWorker, worker_settings
from worker.loop import Worker
from worker.outputs import merge_deltas


def delta(offset: int, tokens: list[int], index: int = 0, finish: str | None = None) -> TokenDelta:
    return TokenDelta(index=index, offset=offset, text="".join(f"<{t}>" for t in tokens), token_ids=tokens,
                      finish_reason=finish)


def test_consecutive_deltas_of_one_completion_join():
    merged = merge_deltas([delta(0, [1]), delta(1, [2, 3]), delta(0, [9], index=1), delta(3, [4], finish="stop"),
                           delta(4, [5])])
    assert [(d.index, d.offset, d.token_ids, d.text, d.finish_reason) for d in merged] == [
        (0, 0, [1, 2, 3], "<1><2><3>", None), (1, 0, [9], "<9>", None), (0, 3, [4], "<4>", "stop"),
        (0, 4, [5], "<5>", None)]  # nothing joins past a finish
    assert len(merge_deltas([delta(0, [1]), delta(5, [2])])) == 2  # a gap: not one run


def test_a_streamed_job_spaced_by_the_interval_writes_few_entries_and_every_token(redis_server, tmp_path):
    settings = worker_settings(tmp_path, redis_server, name="spaced", stream_interval_ms=100)
    handle = RunningWorker(Worker(settings, engine=InstantEngine(tokens_per_step=1, step_s=0.005)))
    try:
        with Client(redis_server, queue="bulk", socket_timeout=30) as client:
            job_id = client.submit("hi", sampling={"max_tokens": 120}, stream=True)
            streamed = [t for d in client.stream_deltas(job_id, timeout=30) for t in d.token_ids]
            assert streamed == client.result(job_id, timeout=30).outputs[0].token_ids and len(streamed) == 120
        with redis.Redis.from_url(redis_server) as r:
            entries = r.xlen(Keys().tokens(job_id))
        # 120 steps of >= 5 ms: >= 0.6 s, written every 100 ms at the most
        assert entries <= 12, f"{entries} entries for 120 tokens"
        assert handle.stop() == 0
    finally:
        if handle.thread.is_alive():
            handle.stop(immediately=True)
