"""Protocol v1.1 with real worker processes: a job whose worker is killed resumes from the
tokens already produced (its tokens stream, or its progress checkpoint), its stream read by
offset gets every token once, and its result is the uninterrupted run's."""

from __future__ import annotations

import json
import re
import signal

from engine import SamplingParams
from producers.protocol import Keys
from tests.worker.conftest import SlowEngine, pending_count, wait_for
from tests.worker.test_process import spawn  # noqa: F401  (the fixture)

KEYS = Keys()
MAX = 160
GREEDY = {"temperature": 0, "max_tokens": MAX, "ignore_eos": True}
SEEDED = {"temperature": 1.0, "seed": 1234, "max_tokens": MAX, "ignore_eos": True}
FAST = ("--no-celery", "--checkpoint-seconds", "0.1")
CLAIM_FAST = ("--claim-idle-seconds", "1")


def offline(make_engine, prompt: str, sampling: dict) -> list[int]:
    """The engine run in-process on the same tiny model: the uninterrupted run."""
    engine = make_engine()
    engine.add_request("offline", prompt, SamplingParams(**sampling), final_only=True)
    final = None
    while engine.has_unfinished_requests():
        final = next(iter(engine.step()), final)
    return final.outputs[0].token_ids


def owner(r, job_id: str) -> str | None:
    return r.hget(KEYS.job(job_id), "worker")


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


def resumes(log: str) -> dict[tuple[str, int], int]:
    """(job, attempt) -> the tokens its run resumed from, as the worker logged it."""
    found = re.findall(r"event=job\.resumed job=(\S+) attempt=(\d+) tokens=(\d+)", log)
    return {(job, int(attempt)): int(tokens) for job, attempt, tokens in found}


def stopped_counts(log: str) -> dict[str, int]:
    line = next(l for l in log.splitlines() if "worker.stopped" in l)
    return {k: int(v) for k, v in re.findall(r"(prompt_tokens|generated_tokens)=(\d+)", line)}


def test_jobs_killed_twice_resume_each_time_and_their_streams_read_exactly(spawn, redis_server, client, r,  # noqa: F811
                                                                           make_engine):
    """Two streamed jobs (resumed from their streams) and two that do not stream (resumed from
    their checkpoints), greedy and seeded, through two kill -9s and a third worker."""
    jobs = {}  # job id -> (prompt, sampling, stream)
    for stream in (True, False):
        for name, sampling in (("greedy", GREEDY), ("seeded", SEEDED)):
            prompt = f"{name} {'stream' if stream else 'checkpoint'}"
            jobs[client.submit(prompt, sampling=sampling, stream=stream)] = (prompt, sampling, stream)

    def progress(job_id: str) -> int:
        return streamed_tokens(r, job_id) if jobs[job_id][2] else len(checkpointed(r, job_id))

    workers = [spawn("--name", "w0", *FAST, *CLAIM_FAST, redis_url=redis_server)]
    at_kill: dict[str, int] = {}
    kills = []  # per kill: each job's tokens before the successor started and at the kill; the jobs it held
    for round_ in range(2):
        floor = {j: at_kill.get(j, 0) + 25 for j in jobs}
        wait_for(lambda: all(owner(r, j) == f"w{round_}" for j in jobs), timeout=90, what=f"w{round_} to run all")
        before = {j: progress(j) for j in jobs}
        # its successor starts while it generates; it takes the jobs once they are idle for a second
        workers.append(spawn("--name", f"w{round_ + 1}", *FAST, *CLAIM_FAST, redis_url=redis_server))
        wait_for(lambda: all(progress(j) >= floor[j] for j in jobs), timeout=90, what=f"progress past {floor}")
        workers[round_].stop(signal.SIGKILL)
        at_kill = {j: progress(j) for j in jobs}
        # NOTE: read after the tokens: a job the successor did not hold yet has not moved since the kill
        taken = {j for j in jobs if owner(r, j) != f"w{round_}"}
        kills.append((before, at_kill, taken))
        assert all(n < MAX for n in at_kill.values()), "the kill should land mid-generation"
    worker = workers[-1]
    for job_id, (prompt, sampling, stream) in jobs.items():
        result = client.result(job_id, timeout=90)
        want = offline(make_engine, prompt, sampling)
        assert result.outputs[0].token_ids == want and result.usage.completion_tokens == MAX
        assert owner(r, job_id) == "w2" and r.hget(KEYS.job(job_id), "attempts") == "3"
        assert r.lrange(KEYS.done(job_id), 0, -1) == ["done"]
        assert r.hget(KEYS.job(job_id), "progress") is None  # the end takes the checkpoint away
        if stream:
            read = list(client.stream_deltas(job_id, timeout=30))
            assert sum((d.token_ids for d in read), []) == want and "".join(d.text for d in read) == result.text
            assert_contiguous(entries(r, job_id))  # the stream was never deleted and refilled
    assert pending_count(r, "interactive") == 0
    assert worker.stop() == 0
    # NOTE: as in test_fencing: a worker refreshes its claims every 0.25 s (a quarter of
    # --claim-idle-seconds 1); one that stalls past 1 s on a loaded machine while its successor runs
    # is silent by that measure, and the successor takes its jobs before the kill, resuming each
    # from where it had got to then (its stale run fenced). That is the product working; it changes
    # only when the successor's run starts, not how many runs there are: a job taken earlier resumes
    # from no less than it had before the successor started and no more than at the kill, any other
    # from exactly what it had at the kill. Two stalls would fail a job at max_attempts 3.
    resumed = [resumes(w.output()) for w in workers]
    for round_, (before, at_kill, taken) in enumerate(kills):
        got = {j: resumed[round_ + 1].get((j, round_ + 2), 0) for j in jobs}
        for job_id in jobs:
            if job_id in taken:
                assert before[job_id] <= got[job_id] <= at_kill[job_id], (round_, before, got, at_kill, taken)
            else:
                assert got[job_id] == at_kill[job_id], (round_, got, at_kill, taken)
    # a restart would generate MAX tokens per job again; the last run generated only the rest
    last = sum(MAX - resumed[2].get((j, 3), 0) for j in jobs)
    assert stopped_counts(worker.output())["generated_tokens"] == last


def test_a_frozen_worker_cannot_checkpoint_over_or_append_to_a_resumed_run(spawn, redis_server, client, r,  # noqa: F811
                                                                           make_engine):
    streamed = client.submit("frozen then resumed", sampling=GREEDY, stream=True)
    checkpointed_job = client.submit("frozen then resumed", sampling=GREEDY)
    progress = {streamed: lambda: streamed_tokens(r, streamed),
                checkpointed_job: lambda: len(checkpointed(r, checkpointed_job))}
    frozen = spawn("--name", "frozen", *FAST, *CLAIM_FAST, redis_url=redis_server)
    wait_for(lambda: all(owner(r, j) == "frozen" for j in progress), timeout=90, what="the first worker to run both")
    taker = spawn("--name", "taker", *FAST, *CLAIM_FAST, redis_url=redis_server)
    wait_for(lambda: all(p() >= 30 for p in progress.values()), timeout=90, what="progress of the first runs")
    frozen.proc.send_signal(signal.SIGSTOP)
    at_freeze = {j: p() for j, p in progress.items()}
    assert all(n < MAX for n in at_freeze.values()), "the freeze should land mid-generation"
    wait_for(lambda: all(r.hget(KEYS.job(j), "worker") == "taker" and p() > at_freeze[j] + 10
                         for j, p in progress.items()), timeout=90, what="the taker to resume both and move on")
    frozen.proc.send_signal(signal.SIGCONT)  # it wakes with both jobs' stale runs in its engine
    want = offline(make_engine, "frozen then resumed", GREEDY)
    ended_by = {}
    for job_id in progress:
        result = client.result(job_id, timeout=90)
        assert result.outputs[0].token_ids == want and result.usage.completion_tokens == MAX
        assert r.lrange(KEYS.done(job_id), 0, -1) == ["done"]
        # NOTE: as in test_fencing: the taker refreshes its claims every 0.25 s (a quarter of
        # --claim-idle-seconds 1); one that stalls past 1 s on a loaded machine is silent by that
        # measure and loses the job as the frozen worker did: it is claimed again (by either worker:
        # attempt 3) and runs on from its stream or checkpoint, the taker's run fenced in turn. That
        # is the product working; the stale runs still wrote nothing, as the checks below show. A
        # fourth start (two stalls) would fail the job at max_attempts 3: not accepted.
        ended_by[job_id] = owner(r, job_id), r.hget(KEYS.job(job_id), "attempts")
        assert ended_by[job_id] in {("taker", "2"), ("taker", "3"), ("frozen", "3")}, ended_by
    assert_contiguous(entries(r, streamed))  # the woken worker appended nothing to the resumed stream
    assert sum((d.token_ids for d in client.stream_deltas(streamed, timeout=30)), []) == want
    wait_for(lambda: frozen.output().count("job.dropped") == 2, timeout=30,
             what="the woken worker to drop both stale runs")
    assert frozen.stop() == 0 and taker.stop() == 0
    logs = {"frozen": frozen.output(), "taker": taker.output()}
    resumed = {name: resumes(log) for name, log in logs.items()}
    for job_id, (by, attempts) in ended_by.items():
        # the taker resumed where the frozen run stopped; a third run where the taker's had got to
        assert resumed["taker"][(job_id, 2)] >= at_freeze[job_id], (resumed, at_freeze)
        if attempts == "3":
            assert resumed[by][(job_id, 3)] >= resumed["taker"][(job_id, 2)], resumed
    # the woken worker ended none of its stale runs: only those it started again, if any
    ended = re.findall(r"event=job\.ended job=(\S+) .*?\battempt=(\d+)", logs["frozen"])
    assert sorted(ended) == sorted((j, "3") for j, (by, _) in ended_by.items() if by == "frozen"), ended


def test_jobs_released_at_a_stop_resume_from_their_stream_and_last_checkpoint(start_worker, client, r, engine,
                                                                             make_engine):
    """A drain that releases its jobs (the start not counted: attempts stays 1) writes a last
    checkpoint; the next worker resumes both jobs and generates only what was missing."""
    streamed = client.submit("released stream", sampling=GREEDY, stream=True)
    plain = client.submit("released plain", sampling=GREEDY)
    # NOTE: an interval longer than the test: the only checkpoint is the one written at the stop
    first = start_worker(SlowEngine(engine), name="leaving", grace_period=0, checkpoint_seconds=600)
    wait_for(lambda: streamed_tokens(r, streamed) >= 20, what="the stream under way")
    assert first.stop() == 0
    at_stop = {streamed: streamed_tokens(r, streamed), plain: len(checkpointed(r, plain))}
    assert all(0 < n < MAX for n in at_stop.values())
    assert {r.hget(KEYS.job(j), "status") for j in at_stop} == {"queued"}
    generated_before = engine.get_stats().num_generation_tokens
    start_worker(name="next")
    for job_id, prompt in ((streamed, "released stream"), (plain, "released plain")):
        result = client.result(job_id, timeout=60)
        assert result.outputs[0].token_ids == offline(make_engine, prompt, GREEDY)
        assert result.outputs[0].cumulative_logprob is None  # the sum over the earlier run is not known
        assert r.hget(KEYS.job(job_id), "attempts") == "1"
    assert_contiguous(entries(r, streamed))
    assert engine.get_stats().num_generation_tokens - generated_before == sum(MAX - n for n in at_stop.values())
