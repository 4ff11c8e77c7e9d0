"""The worker end to end in-process: real redis-server, real CPU engine on a tiny model."""

from __future__ import annotations

import gc
import json
import sys

import pytest

from producers.errors import JobCancelled, JobExpired, JobFailed
from producers.protocol import Keys, TokenDelta, WorkerInfo
from tests.worker.conftest import ENGINE_ARGS, SlowEngine, pending_count, wait_for
from worker.switching import SWITCH_INTERVAL_S, fast_switching

KEYS = Keys()

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
JOBS = [
    dict(prompt="What is the capital of France?", sampling={"temperature": 0, "max_tokens": 12}),
    dict(prompt="Queues hold jobs;", sampling={"temperature": 0, "max_tokens": 20, "stop": ["Hello"]}),
    dict(prompt_token_ids=[5, 17, 42, 99, 3], sampling={"temperature": 0, "max_tokens": 9}),
    dict(messages=[{"role": "user", "content": "Hello, world!"}], sampling={"temperature": 0, "max_tokens": 8}),
    dict(prompt="Grade the following answer", sampling={"temperature": 0.8, "seed": 7, "max_tokens": 10, "n": 3}),
    dict(prompt="The quick brown fox", sampling={"temperature": 1.0, "top_p": 0.9, "seed": 3, "max_tokens": 14}),
    # v1.3: tools and a tool call's turn reach the chat template (arguments as an object, as offline)
    dict(messages=[{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}],
         tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}}],
         sampling={"temperature": 0, "max_tokens": 6}),
]


def offline(tiny_model, jobs):
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_model), **ENGINE_ARGS)
    try:
        outs = []
        for job in jobs:
            params = SamplingParams.from_dict(job["sampling"])
            if "messages" in job:
                outs += llm.chat(job["messages"], params, use_tqdm=False, tools=job.get("tools"))
            elif "prompt" in job:
                outs += llm.generate(job["prompt"], params, use_tqdm=False)
            else:
                outs += llm.generate({"prompt_token_ids": job["prompt_token_ids"]}, params, use_tqdm=False)
        return outs
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("late_admission", [False, True])
def test_results_through_the_queue_equal_offline_generate(start_worker, client, r, tiny_model, engine,
                                                          monkeypatch, late_admission):
    """With ``late_admission`` the jobs join the engine inside its step, just before it schedules."""
    hooks, real_step = [], engine.step

    def step(before_schedule=None):
        hooks.append(before_schedule is not None)
        return real_step(before_schedule) if before_schedule is not None else real_step()

    monkeypatch.setattr(engine, "step", step)
    ids = [client.submit(**job, metadata={"row": i}) for i, job in enumerate(JOBS)]
    handle = start_worker(late_admission=late_admission)
    results = [client.result(job_id, timeout=30) for job_id in ids]
    # while it runs, a short switch interval and the start-up heap out of the collector's walks
    # (worker/loop.py says why); undone by the last worker of the process to stop (the tests of
    # fast_switching and of engine/gc_pauses.py check that: another test's worker may still run)
    assert sys.getswitchinterval() == SWITCH_INTERVAL_S
    assert gc.get_freeze_count() > 10_000  # torch, the model, the block manager
    handle.stop()
    expected = offline(tiny_model, JOBS)
    for i, (got, want) in enumerate(zip(results, expected)):
        assert got.metadata == {"row": i}
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs], JOBS[i]
        assert [o.text for o in got.outputs] == [o.text for o in want.outputs]
        assert [o.finish_reason for o in got.outputs] == [o.finish_reason for o in want.outputs]
        assert got.text == want.outputs[0].text
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.timings.total_s is not None and got.timings.queue_s is not None
        t = got.timings  # the stages before the first token, each from enqueued, in order
        assert 0 <= t.read_s <= t.ready_s <= t.queue_s <= t.scheduled_s <= t.launched_s <= t.queue_s + t.ttft_s
        assert t.queue_s + t.ttft_s <= t.total_s
    assert len(results[4].outputs) == 3
    assert hooks and set(hooks) == {late_admission}  # every step got the admission hook, or none did
    for job_id in ids:
        assert r.hget(KEYS.job(job_id), "status") == "done"
        assert r.lrange(KEYS.done(job_id), 0, -1) == ["done"]
        assert 0 < r.ttl(KEYS.job(job_id)) <= 86400
    assert pending_count(r, "interactive") == 0 and r.xlen(KEYS.queue("interactive")) == 0


def test_the_switch_interval_comes_back_when_the_last_worker_stops_in_any_order():
    before = sys.getswitchinterval()
    fast_switching(True)  # worker A starts
    fast_switching(True)  # worker B starts
    fast_switching(False)  # A stops first: B still runs
    assert sys.getswitchinterval() == SWITCH_INTERVAL_S
    fast_switching(False)
    assert sys.getswitchinterval() == before
    fast_switching(False)  # one stop too many changes nothing
    assert sys.getswitchinterval() == before


def test_entries_pushed_by_hand_before_any_worker_ran_are_consumed(start_worker, r):
    """A raw XADD from any client, before the stream or group exists: no job hash, no client."""
    job = {"v": 1, "id": "by-hand-1", "prompt": "Hello", "sampling": {"max_tokens": 4, "temperature": 0}}
    r.xadd(KEYS.queue("bulk"), {"job": json.dumps(job)})
    start_worker()
    assert r.blmove(KEYS.done("by-hand-1"), KEYS.done("by-hand-1"), 20) == "done"
    fields = r.hgetall(KEYS.job("by-hand-1"))
    assert fields["status"] == "done" and fields["attempts"] == "1" and fields["queue"] == "bulk"
    assert json.loads(fields["result"])["usage"]["completion_tokens"] == 4


def test_interactive_before_bulk_and_priority_within_the_engine(start_worker, client, r, make_engine):
    one_at_a_time = make_engine(max_num_seqs=1)  # admits 2 at a time: 1 running + 1 waiting
    sampling = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    bulk = [client.submit(f"bulk {i}", sampling=sampling, queue="bulk") for i in range(4)]
    low = client.submit("low", sampling=sampling, queue="interactive")
    high = client.submit("high", sampling=sampling, queue="interactive", priority=5)
    start_worker(one_at_a_time)
    for job_id in bulk + [low, high]:
        client.result(job_id, timeout=30)
    finished = {j: float(r.hget(KEYS.job(j), "finished_at")) for j in bulk + [low, high]}
    assert finished[high] < finished[low] < min(finished[b] for b in bulk)
    assert [finished[b] for b in bulk] == sorted(finished[b] for b in bulk)


def test_streaming_deltas_add_up_to_the_result(start_worker, client, r):
    job_id = client.submit("Continuous batching lets", sampling={"temperature": 0, "max_tokens": 24, "n": 2, "seed": 1},
                           stream=True)
    start_worker()
    deltas = list(client.stream_deltas(job_id, timeout=30))
    result = client.result(job_id, timeout=5)
    for out_index, completion in enumerate(result.outputs):
        mine = [d for d in deltas if d.index == out_index]
        assert "".join(d.text for d in mine) == completion.text
        assert sum((d.token_ids for d in mine), []) == completion.token_ids
        assert mine[-1].finish_reason == completion.finish_reason
        assert all(d.finish_reason is None for d in mine[:-1])
    entries = r.xrange(KEYS.tokens(job_id))
    assert len(entries) > 2 and 0 < r.ttl(KEYS.tokens(job_id)) <= 86400


def test_cancel_a_running_job_and_a_queued_one(start_worker, client, r, engine):
    long = {"temperature": 0, "max_tokens": 480, "ignore_eos": True}
    running = client.submit("Hello", sampling=long, stream=True)
    queued = client.submit("Hello again", sampling=long, queue="bulk")
    client.cancel(queued)  # before any worker reads it: it ends at once
    assert r.hget(KEYS.job(queued), "status") == "cancelled" and r.xlen(KEYS.queue("bulk")) == 0
    start_worker(SlowEngine(engine))
    wait_for(lambda: r.xlen(KEYS.tokens(running)) > 0, what="the first streamed token")
    assert client.cancel(running)
    with pytest.raises(JobCancelled):
        client.result(running, timeout=20)
    with pytest.raises(JobCancelled):
        client.result(queued, timeout=20)
    assert r.hget(KEYS.job(queued), "attempts") == "0"  # never started
    for job_id in (running, queued):
        assert r.lrange(KEYS.done(job_id), 0, -1) == ["cancelled"]
        assert not r.exists(KEYS.cancel(job_id))
    last = TokenDelta.from_fields(r.xrevrange(KEYS.tokens(running), count=1)[0][1])
    assert last.finish_reason == "cancelled"
    wait_for(lambda: pending_count(r, "interactive") == 0, what="the cancelled job acknowledged")


def test_deadlines_expire_jobs_queued_and_running(start_worker, client, r, engine):
    import time

    gone = client.submit("late", sampling={"max_tokens": 4}, deadline=time.time() - 1)
    start_worker(SlowEngine(engine, step_s=0.02))  # 480 tokens take >= 9.6 s: the deadline comes first
    client.result(client.submit("warm", sampling={"max_tokens": 1}), timeout=20)  # reading, and idle
    # NOTE: 2 s for an idle worker to start the job (one short read) even on a loaded machine.
    running = client.submit("Hello", sampling={"temperature": 0, "max_tokens": 480, "ignore_eos": True},
                            deadline=time.time() + 2.0)
    for job_id in (gone, running):
        with pytest.raises(JobExpired):
            client.result(job_id, timeout=20)
        assert r.lrange(KEYS.done(job_id), 0, -1) == ["expired"]
    assert "before the job started" in r.hget(KEYS.job(gone), "error")
    assert "while running" in r.hget(KEYS.job(running), "error")
    assert r.hget(KEYS.job(running), "attempts") == "1"


def test_garbage_is_failed_and_dead_lettered_and_the_worker_goes_on(start_worker, client, r):
    queue = KEYS.queue("interactive")
    r.xadd(queue, {"job": "{not json"})
    r.xadd(queue, {"payload": "hello"})
    r.xadd(queue, {"job": json.dumps([1, 2])})
    r.xadd(queue, {"job": json.dumps({"v": 2, "id": "future-1", "prompt": "x"})})
    r.xadd(queue, {"job": json.dumps({"v": 1, "id": "bad-temp", "prompt": "x", "sampling": {"temperature": -1}})})
    r.xadd(queue, {"job": json.dumps({"v": 1, "id": "two-prompts", "prompt": "x", "prompt_token_ids": [1]})})
    r.xadd(queue, {"job": json.dumps({"v": 1, "id": "bad id!", "prompt": "x"})})
    good = client.submit("Hello", sampling={"max_tokens": 3, "ignore_eos": True})
    start_worker()
    client.result(good, timeout=20)
    wait_for(lambda: r.xlen(KEYS.dead) == 7, what="seven dead letters")
    dead = [fields for _, fields in r.xrange(KEYS.dead)]
    assert all(d["queue"] == "interactive" and d["entry_id"] and d["error"].startswith("invalid job") for d in dead)
    errors = {d["job_id"]: d["error"] for d in dead}
    assert "not valid UTF-8 JSON" in dead[0]["error"] and "no 'job' field (fields: payload)" in dead[1]["error"]
    assert json.loads(dead[1]["entry"]) == {"payload": "hello"}
    assert "v: unsupported protocol version 2" in errors["future-1"]
    assert "sampling" in errors["bad-temp"] and "temperature" in errors["bad-temp"]
    assert "exactly one of prompt" in errors["two-prompts"]
    for job_id in ("future-1", "bad-temp", "two-prompts"):
        assert r.hget(KEYS.job(job_id), "status") == "failed"
        assert r.hget(KEYS.job(job_id), "error") == errors[job_id]
        assert r.lrange(KEYS.done(job_id), 0, -1) == ["failed"]
        with pytest.raises(JobFailed):
            client.result(job_id, timeout=1)
    assert pending_count(r, "interactive") == 0 and r.xlen(queue) == 0


def test_jobs_beyond_the_context_or_vocabulary_fail_alone(start_worker, client, r, engine):
    too_long = client.submit(prompt_token_ids=[7] * (engine.max_model_len + 1), sampling={"max_tokens": 1})
    too_many = client.submit("Hello", sampling={"max_tokens": engine.max_model_len})
    bad_token = client.submit(prompt_token_ids=[engine.vocab_size + 5], sampling={"max_tokens": 1})
    good = client.submit("Hello", sampling={"max_tokens": 3, "ignore_eos": True})
    start_worker()
    assert client.result(good, timeout=20).usage.completion_tokens == 3
    for job_id, words in ((too_long, "max_model_len"), (too_many, "max_tokens"), (bad_token, "not a token id")):
        with pytest.raises(JobFailed):
            client.result(job_id, timeout=5)
        assert words in r.hget(KEYS.job(job_id), "error")


class PoisonedEngine:
    """The real engine, except that a step raises while a request whose prompt starts with
    token 13 is in it -- an engine bug that only some inputs trigger. ``late``: the fault
    shows only from the request's second step on, as an error in reading back a step's
    tokens does under async scheduling (each step reads back the one before)."""

    def __init__(self, engine, late: bool = False):
        self._engine = engine
        self._late = late
        self._seen: set[str] = set()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        for rid, req in self._engine.requests.items():
            if req.prompt_token_ids[0] == 13:
                if rid in self._seen or not self._late:
                    raise RuntimeError("kernel fault on token 13")
                self._seen.add(rid)
        return self._engine.step()


@pytest.mark.parametrize("late", [False, True], ids=["at-once", "a-step-late"])
def test_an_engine_error_fails_only_the_jobs_involved(start_worker, client, r, engine, late):
    sampling = {"temperature": 0, "max_tokens": 5}
    ids = [client.submit(prompt_token_ids=[13 if i == 2 else 20 + i, 30, 31], sampling=sampling) for i in range(5)]
    start_worker(PoisonedEngine(engine, late))
    for i, job_id in enumerate(ids):
        if i == 2:
            with pytest.raises(JobFailed, match="kernel fault on token 13"):
                client.result(job_id, timeout=20)
        else:
            assert client.result(job_id, timeout=20).usage.completion_tokens == 5


def test_the_worker_registers_itself_and_leaves_on_stop(start_worker, r):
    handle = start_worker(name="registered")
    raw = wait_for(lambda: r.hget(KEYS.workers, "registered"), what="the heartbeat record")
    info = WorkerInfo.model_validate_json(raw)
    assert info.queues == ["interactive", "bulk"] and info.alive(info.last_seen)
    assert handle.stop() == 0
    assert r.hget(KEYS.workers, "registered") is None


def test_the_swap_pool_follows_the_backlog(start_worker, client, engine, caplog):
    caplog.set_level("INFO", logger="worker")
    client.submit_many([{"prompt": f"job {i}", "sampling": {"max_tokens": 100, "ignore_eos": True}}
                        for i in range(40)], queue="bulk")
    handle = start_worker(SlowEngine(engine), swap_floor_gib=0.001, swap_cap_gib=0.01)
    sizer = handle.worker.swap
    cap = int(0.01 * (1 << 30))
    # NOTE: the loop's thread sets requested before it logs the resize: wait for the record too
    wait_for(lambda: sizer.requested == cap and any(
        r.getMessage() == "swap.resized" and r.fields["target_bytes"] == cap for r in caplog.records),
        what="the pool sized to the deep backlog")
    assert 0 < sizer.current <= cap
    resized = [r for r in caplog.records if r.getMessage() == "swap.resized"]
    assert resized and resized[-1].fields["backlog"] > 8 and resized[-1].fields["to_bytes"] == sizer.current


def test_the_worker_reads_no_more_than_the_engine_can_admit(start_worker, client, r, make_engine):
    one_at_a_time = make_engine(max_num_seqs=1)  # admission capacity 2: one running, one waiting
    ids = client.submit_many([{"prompt": f"job {i}", "sampling": {"max_tokens": 20, "ignore_eos": True}}
                              for i in range(12)], queue="bulk")
    engine = HeldCounter(one_at_a_time, step_s=0.002)
    engine.worker = start_worker(engine).worker
    assert all(client.result(j, timeout=20).usage.completion_tokens == 20 for j in ids)
    # Held (read, not acknowledged) = in the engine + handed in + ended, their ends not yet stored.
    assert engine.samples and max(held - unwritten for unwritten, held in engine.samples) <= 2
    assert max(held for _, held in engine.samples) >= 2


class HeldCounter(SlowEngine):
    """Records, at each step, (ends not yet written, jobs held) of the worker it serves."""

    worker = None

    def __init__(self, engine, step_s: float) -> None:
        super().__init__(engine, step_s)
        self.samples: list[tuple[int, int]] = []

    def step(self):
        if self.worker is not None:  # NOTE: unwritten first: a write landing in between only lowers held
            self.samples.append((self.worker.writer._unwritten, len(self.worker.held)))
        return super().step()


def test_an_entry_whose_keys_are_broken_is_dead_lettered_not_retried(start_worker, client, r):
    broken = client.submit("Hello", sampling={"max_tokens": 3}, job_id="broken-1")
    r.delete(KEYS.job(broken))
    r.set(KEYS.job(broken), "someone wrote a string here")  # every script on this job fails
    good = client.submit("Hello", sampling={"max_tokens": 3, "ignore_eos": True})
    start_worker()
    assert client.result(good, timeout=20).usage.completion_tokens == 3
    wait_for(lambda: r.xlen(KEYS.dead) == 1, what="the dead letter")
    (_, dead), = r.xrange(KEYS.dead)
    assert "could not settle" in dead["error"] and "WRONGTYPE" in dead["error"]
    assert pending_count(r, "interactive") == 0


def test_lane_outputs_handed_over_mid_launch_stamp_stream_and_end_their_jobs(start_worker, client, make_engine,
                                                                            tiny_model, monkeypatch):
    """The express lane reads back a lane step in the middle of a long launch and hands its outputs
    to the worker there (``LLMEngine.on_lane_outputs``): the first token is stamped and streamed
    at once, a job that the lane step finishes ends there too, and results are unchanged.
    On a CPU a launch is one piece, so the executor here looks for arrivals as a launch of graph
    pieces would: until the interactive job it submitted runs in the lane, then once more."""
    import time

    engine = make_engine(express_lane_tokens=16, block_size=4, max_num_seqs=8)
    launch, calls, handed = engine.executor.execute, [], []
    jobs = {"one": dict(prompt_token_ids=[7, 8, 9, 10, 11], sampling={"temperature": 0, "max_tokens": 1}),
            "streamed": dict(prompt_token_ids=[4, 5, 6], sampling={"temperature": 0, "max_tokens": 5}, stream=True)}
    ids: dict[str, str] = {}

    def launch_looking(out, fed_tokens=None, between=None):
        logits = launch(out, fed_tokens)
        calls.append(1)
        name = {3: "one", 6: "streamed"}.get(len(calls))
        if between is not None and name is not None:  # it arrives while this launch runs
            ids[name] = client.submit(**jobs[name], queue="interactive")
            deadline = time.monotonic() + 20
            while engine.lane.in_flight is None and time.monotonic() < deadline:
                between()  # admits it once the reader and the preparer have it, and runs it in the lane
            between()  # the next look reads the lane step back
        return logits

    real_hook = engine.on_lane_outputs

    def hook(deliver):
        real_hook(None if deliver is None else lambda outs: (handed.extend(o.request_id for o in outs), deliver(outs)))

    monkeypatch.setattr(engine.executor, "execute", launch_looking)
    monkeypatch.setattr(engine, "on_lane_outputs", hook)
    bulk = [client.submit(prompt_token_ids=[3 + i] * 12, sampling={"temperature": 0, "max_tokens": 24}, queue="bulk")
            for i in range(2)]
    handle = start_worker(engine, late_admission=True, queues="interactive,bulk")
    wait_for(lambda: len(ids) == 2, what="both interactive jobs submitted")
    results = {name: client.result(job_id, timeout=30) for name, job_id in ids.items()}
    streamed = "".join(client.stream(ids["streamed"], timeout=30))
    for job_id in bulk:
        client.result(job_id, timeout=30)
    handle.stop()
    assert set(ids.values()) <= set(handed), "both lane steps were handed over mid-launch"
    assert engine.scheduler.stats.num_express == 2
    expected = dict(zip(ids, offline(tiny_model, [jobs[name] for name in ids])))
    for name, got in results.items():
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in expected[name].outputs], name
        assert got.timings.ttft_s is not None and got.timings.ttft_s <= got.timings.total_s
    assert len(results["one"].outputs[0].token_ids) == 1
    assert streamed == results["streamed"].text
