"""Protocol v1.1 with real worker processes: a job whose worker is killed resumes from the
tokens already produced (its tokens stream, or its progress checkpoint), its stream read by
offset gets every token once, and its result is the uninterrupted run's."""

from __future__ import annotations

import json
import re
import signal

import pytest

from engine import SamplingParams
from producers.protocol import Keys
from tests.worker.conftest import pending_count, wait_for
from tests.worker.test_process import spawn  # noqa: F401  (the fixture)

KEYS = Keys()
GREEDY = {"temperature": 0, "max_tokens": 300, "ignore_eos": True}
SEEDED = {"temperature": 1.0, "seed": 1234, "max_tokens": 300, "ignore_eos": True}
FAST = ("--no-celery", "--checkpoint-seconds", "0.1")


def offline(make_engine, prompt: str, sampling: dict) -> list[int]:
    """The engine run in-process on the same tiny model: the uninterrupted run."""
    engine = make_engine()
    engine.add_request("offline", prompt, SamplingParams(**sampling), final_only=True)
    final = None
    while engine.has_unfinished_requests():
        final = next(iter(engine.step()), final)
    return final.outputs[0].token_ids


def entries(r, job_id: str) -> list[dict]:
    return [fields for _, fields in r.xrange(KEYS.tokens(job_id))]


def streamed_tokens(r, job_id: str) -> int:
    return sum(len(json.loads(e["token_ids"])) for e in entries(r, job_id))


def checkpointed(r, job_id: str) -> list[int]:
    raw = r.hget(KEYS.job(job_id), "progress")
    return json.loads(raw)["token_ids"] if raw else []


def assert_contiguous(stream: list[dict]) -> None:
    """Each entry starts where the entries before it end: nothing was refilled or repeated."""
    have = 0
    for e in stream:
        assert int(e["offset"]) == have, (e, have)
        have += len(json.loads(e["token_ids"]))


def resumed_counts(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"job\.resumed .*?tokens=(\d+)", log)]


def stopped_counts(log: str) -> dict[str, int]:
    line = next(l for l in log.splitlines() if "worker.stopped" in l)
    return {k: int(v) for k, v in re.findall(r"(prompt_tokens|generated_tokens)=(\d+)", line)}


def test_a_stream_killed_twice_resumes_each_time_and_reads_exactly(spawn, redis_server, client, r,  # noqa: F811
                                                                   make_engine):
    jobs = {client.submit("the stream", sampling=GREEDY, stream=True): GREEDY,
            client.submit("the seeded stream", sampling=SEEDED, stream=True): SEEDED}
    at_kill = {}
    for round_ in range(2):
        worker = spawn("--name", "crashy", *FAST, redis_url=redis_server)
        floor = {j: at_kill.get(j, 0) + 40 for j in jobs}
        wait_for(lambda: all(streamed_tokens(r, j) >= floor[j] for j in jobs), timeout=90,
                 what=f"both streams past {floor} tokens")
        worker.stop(signal.SIGKILL)
        at_kill = {j: streamed_tokens(r, j) for j in jobs}
        assert all(n < 300 for n in at_kill.values()), "the kill should land mid-stream"
        assert all(r.hget(KEYS.job(j), "attempts") == str(round_ + 1) for j in jobs)
    last = spawn("--name", "crashy", *FAST, redis_url=redis_server)  # same name: its own pending entries first
    for job_id, sampling in jobs.items():
        result = client.result(job_id, timeout=90)
        read = list(client.stream_deltas(job_id, timeout=30))
        want = offline(make_engine, "the stream" if sampling is GREEDY else "the seeded stream", sampling)
        assert result.outputs[0].token_ids == want and result.usage.completion_tokens == 300
        assert sum((d.token_ids for d in read), []) == want and "".join(d.text for d in read) == result.text
        assert_contiguous(entries(r, job_id))  # the stream was never deleted and refilled
        assert r.hget(KEYS.job(job_id), "attempts") == "3" and r.lrange(KEYS.done(job_id), 0, -1) == ["done"]
    assert sorted(resumed_counts(last.output())) == sorted(at_kill.values())
    assert pending_count(r, "interactive") == 0
    assert last.stop() == 0
    # the last run generated only what the killed ones had not
    assert stopped_counts(last.output())["generated_tokens"] == sum(300 - n for n in at_kill.values())


def test_a_killed_job_that_does_not_stream_resumes_from_its_checkpoint(spawn, redis_server, client, r,  # noqa: F811
                                                                       make_engine):
    jobs = {client.submit("checkpointed greedy", sampling=GREEDY): GREEDY,
            client.submit("checkpointed seeded", sampling=SEEDED): SEEDED}
    first = spawn("--name", "first", *FAST, redis_url=redis_server)
    wait_for(lambda: all(len(checkpointed(r, j)) >= 40 for j in jobs), timeout=90, what="two checkpoints")
    first.stop(signal.SIGKILL)
    saved = {j: len(checkpointed(r, j)) for j in jobs}
    assert all(n < 300 for n in saved.values()), "the kill should land mid-generation"
    # another worker claims the dead one's entries once they have been idle for a second
    second = spawn("--name", "second", *FAST, "--claim-idle-seconds", "1", redis_url=redis_server)
    for job_id, sampling in jobs.items():
        result = client.result(job_id, timeout=90)
        prompt = "checkpointed greedy" if sampling is GREEDY else "checkpointed seeded"
        assert result.outputs[0].token_ids == offline(make_engine, prompt, sampling)
        assert result.usage.completion_tokens == 300 and r.hget(KEYS.job(job_id), "progress") is None
        assert r.hget(KEYS.job(job_id), "attempts") == "2"
    assert sorted(resumed_counts(second.output())) == sorted(saved.values())
    assert second.stop() == 0
    counts = stopped_counts(second.output())
    # a restart would generate 300 tokens per job again; the resumed runs generated only the rest
    assert counts["generated_tokens"] == sum(300 - n for n in saved.values()) < 2 * 300


@pytest.mark.parametrize("stream", [False, True], ids=["checkpoint", "stream"])
def test_a_frozen_worker_cannot_checkpoint_over_or_append_to_a_resumed_run(spawn, redis_server, client, r,  # noqa: F811
                                                                           make_engine, stream):
    job_id = client.submit("frozen then resumed", sampling=GREEDY, stream=stream)
    progress = (lambda: streamed_tokens(r, job_id)) if stream else (lambda: len(checkpointed(r, job_id)))
    frozen = spawn("--name", "frozen", *FAST, "--claim-idle-seconds", "1", redis_url=redis_server)
    wait_for(lambda: progress() >= 40, timeout=90, what="progress of the first run")
    frozen.proc.send_signal(signal.SIGSTOP)
    at_freeze = progress()
    taker = spawn("--name", "taker", *FAST, "--claim-idle-seconds", "1", redis_url=redis_server)
    wait_for(lambda: r.hget(KEYS.job(job_id), "worker") == "taker" and progress() > at_freeze + 20,
             timeout=90, what="the taker to resume and move on")
    frozen.proc.send_signal(signal.SIGCONT)  # it wakes with the job's stale run in its engine
    result = client.result(job_id, timeout=90)
    assert result.outputs[0].token_ids == offline(make_engine, "frozen then resumed", GREEDY)
    assert resumed_counts(taker.output()) and resumed_counts(taker.output())[0] >= at_freeze
    if stream:
        assert_contiguous(entries(r, job_id))  # the woken worker appended nothing
        read = list(client.stream_deltas(job_id, timeout=30))
        assert sum((d.token_ids for d in read), []) == result.outputs[0].token_ids
    wait_for(lambda: "job.dropped" in frozen.output(), timeout=30, what="the woken worker to drop its stale run")
    assert frozen.stop() == 0 and taker.stop() == 0
    assert "job.ended" not in frozen.output() and r.lrange(KEYS.done(job_id), 0, -1) == ["done"]
