"""Hostile entries, pushed raw (bypassing the client): each fails alone, by field, and nothing wedges.

Every job must end with exactly one terminal status -- the bad ones ``failed`` with an error
naming the field and the limit, the good ones ``done`` -- nothing stays ``queued`` and the
pending list drains to 0.
"""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import redis

from producers.errors import JobExpired, JobFailed
from producers.protocol.limits import (
    MAX_JSON_DEPTH,
    MAX_MESSAGES,
    MAX_METADATA_BYTES,
    MAX_N,
    MAX_PROMPT_BYTES,
    MAX_PROMPT_TOKEN_IDS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from producers.protocol import SUBMIT_SCRIPT, Keys, submit_keys
from tests.worker.conftest import SlowEngine, pending_count, wait_for
from tests.worker.test_process import spawn  # noqa: F401  (a fixture)
from worker.cancel import Deadlines

KEYS = Keys()
QUEUE = "interactive"
SHORT = {"temperature": 0, "max_tokens": 2}


def good_job(job_id: str) -> str:
    return json.dumps({"v": 1, "id": job_id, "prompt": "Hello", "sampling": SHORT})


def submit_raw(r: redis.Redis, job_id: str, raw: bytes | str, queue: str = QUEUE) -> None:
    """What a producer in another language does: the documented submit script, any bytes as the job."""
    r.eval(SUBMIT_SCRIPT, 5, *submit_keys(KEYS, job_id, queue), raw, repr(time.time()), queue, "0")


def ended(r: redis.Redis, job_id: str, timeout: float = 30.0) -> str | None:
    """Wait for the job's done signal; return it (None when it never came)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # NOTE: short blocking calls, under the client's socket timeout
        signal = r.blmove(KEYS.done(job_id), KEYS.done(job_id), 1)
        if signal is not None:
            return signal
    return None


def assert_ended_once(r: redis.Redis, job_id: str, status: str) -> dict:
    fields = r.hgetall(KEYS.job(job_id))
    assert fields.get("status") == status, (job_id, fields.get("status"), fields.get("error"))
    assert r.lrange(KEYS.done(job_id), 0, -1) == [status]
    return fields


def dead_letters(r: redis.Redis) -> dict[str, dict]:
    return {fields["job_id"]: fields for _, fields in r.xrange(KEYS.dead)}


def assert_drained(r: redis.Redis, queue: str = QUEUE) -> None:
    wait_for(lambda: pending_count(r, queue) == 0, what="the pending list to drain")
    assert r.xlen(KEYS.queue(queue)) == 0


def test_a_deeply_nested_entry_fails_alone_and_the_twenty_jobs_read_with_it_run(start_worker, r):
    queue = KEYS.queue(QUEUE)
    nested = '{"v": 1, "id": "nested-1", "prompt": "x", "metadata": {"a": ' + "[" * 1000 + "]" * 1000 + "}}"
    assert len(nested) < 2100  # a 2 KB entry
    r.xadd(queue, {"job": nested})
    good = [f"good-{i}" for i in range(20)]
    for job_id in good:
        r.xadd(queue, {"job": good_job(job_id)})
    start_worker()  # its first read takes the nested entry and the 7 behind it in one batch
    for job_id in good:
        assert ended(r, job_id) == "done"
    assert ended(r, "nested-1") == "failed"
    error = assert_ended_once(r, "nested-1", "failed")["error"]
    assert f"nested deeper than {MAX_JSON_DEPTH} levels (MAX_JSON_DEPTH)" in error
    assert dead_letters(r)["nested-1"]["error"] == error
    for job_id in good:
        assert_ended_once(r, job_id, "done")
    assert_drained(r)


def test_undecodable_and_unparsable_values_with_a_readable_id_fail_their_queued_job(start_worker, client, r):
    bad = {
        "bad-utf8": (b'{"v": 1, "id": "bad-utf8", "prompt": "x", "metadata": {"note": "caf\xe9 \xff"}}',
                     ["metadata.note", "0xe9", "not valid UTF-8"]),
        "huge-int": (b'{"v": 1, "id": "huge-int", "prompt": "x", "metadata": {"count": ' + b"7" * 5000 + b"}}",
                     ["metadata.count", "5,000 digits", "MAX_INT_DIGITS"]),
        "surrogate": (b'{"v": 1, "id": "surrogate", "prompt": "x", "metadata": {"title": "cut \\ud83d"}}',
                      ["metadata.title", "lone UTF-16 surrogate \\ud83d"]),
        "overflow": (b'{"v": 1, "id": "overflow", "prompt": "x", "sampling": {"top_p": 1e999}}',
                     ["sampling.top_p", "1e999", "finite"]),
    }
    for job_id, (raw, _) in bad.items():
        submit_raw(r, job_id, raw)
        assert r.hget(KEYS.job(job_id), "status") == "queued"
    after = client.submit("Hello", sampling=SHORT)
    start_worker()
    assert ended(r, after) == "done"
    letters = dead_letters(r)
    for job_id, (_, words) in bad.items():
        assert ended(r, job_id) == "failed"
        error = assert_ended_once(r, job_id, "failed")["error"]
        assert all(w in error for w in words), error
        assert letters[job_id]["error"] == error
        with pytest.raises(JobFailed):
            client.result(job_id, timeout=1)
    assert_drained(r)


def test_a_non_finite_deadline_is_refused_and_other_deadlines_still_expire(start_worker, client, r, engine):
    for job_id, literal in (("nan-deadline", "NaN"), ("inf-deadline", "Infinity"), ("big-deadline", "1e999")):
        submit_raw(r, job_id, '{"v": 1, "id": "%s", "prompt": "Hello", "deadline": %s,'
                              ' "sampling": {"max_tokens": 4}}' % (job_id, literal))
    long = {"temperature": 0, "max_tokens": 480, "ignore_eos": True}
    expiring = client.submit("Hello", sampling=long, deadline=time.time() + 1.0)
    start_worker(SlowEngine(engine))
    with pytest.raises(JobExpired):
        client.result(expiring, timeout=20)
    assert_ended_once(r, expiring, "expired")
    for job_id in ("nan-deadline", "inf-deadline", "big-deadline"):
        assert ended(r, job_id) == "failed"
        error = assert_ended_once(r, job_id, "failed")["error"]
        assert error.startswith("invalid job: deadline:") and "finite" in error, error
    assert_drained(r)


def test_the_deadline_heap_never_lets_a_bad_value_block_the_others():
    deadlines = Deadlines()
    deadlines.add("nan", math.nan)
    deadlines.add("soon", 100.0)
    deadlines.add("later", 200.0)
    assert deadlines.expired(150.0) == ["soon"]
    assert deadlines.expired(250.0) == ["later"]
    assert len(deadlines) == 0


def oversized_jobs() -> dict[str, tuple[dict, list[str]]]:
    """Job id -> (job, words its error must hold): one per limit, each just past it."""
    def job(job_id: str, **fields) -> dict:
        return {"v": 1, "id": job_id, **({"prompt": "x"} if not ({"prompt_token_ids", "messages"} & set(fields))
                                         else {}), **fields}

    return {
        "big-n": (job("big-n", sampling={"n": 1_000_000}), ["sampling", "n:", "1000000", f"limit of {MAX_N}", "MAX_N"]),
        "big-prompt": (job("big-prompt", prompt="a" * (MAX_PROMPT_BYTES + 1)),
                       ["prompt:", f"{MAX_PROMPT_BYTES + 1:,} bytes", "MAX_PROMPT_BYTES"]),
        "many-stops": (job("many-stops", sampling={"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}),
                       ["stop:", f"{MAX_STOP_STRINGS + 1} strings", "MAX_STOP_STRINGS"]),
        "long-stop": (job("long-stop", sampling={"stop": ["z" * (MAX_STOP_STRING_CHARS + 1)]}),
                      ["stop.0", f"{MAX_STOP_STRING_CHARS + 1} characters", "MAX_STOP_STRING_CHARS"]),
        "many-stop-ids": (job("many-stop-ids", sampling={"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}),
                          ["stop_token_ids", "MAX_STOP_TOKEN_IDS"]),
        "many-token-ids": (job("many-token-ids", prompt_token_ids=[1] * (MAX_PROMPT_TOKEN_IDS + 1)),
                           ["prompt_token_ids", "MAX_PROMPT_TOKEN_IDS"]),
        "many-messages": (job("many-messages", messages=[{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)),
                          ["messages", "MAX_MESSAGES"]),
        "big-metadata": (job("big-metadata", metadata={"blob": "m" * MAX_METADATA_BYTES}),
                         ["metadata", "MAX_METADATA_BYTES"]),
    }


def test_requests_past_a_limit_fail_by_field_before_any_heavy_work(start_worker, client, r):
    jobs = oversized_jobs()
    for job_id, (job, _) in jobs.items():
        submit_raw(r, job_id, json.dumps(job))
    after = client.submit("Hello", sampling=SHORT)
    started = time.monotonic()
    start_worker()
    assert ended(r, after) == "done"
    letters = dead_letters(r)
    for job_id, (_, words) in jobs.items():
        assert ended(r, job_id) == "failed"
        error = assert_ended_once(r, job_id, "failed")["error"]
        assert all(w in error for w in words), error
        assert letters[job_id]["error"] == error  # refused as the entry was read: nothing tokenized, nothing run
    assert time.monotonic() - started < 20
    assert_drained(r)


class StepClock:
    """The real engine, with every step written down (its time, and the CPU seconds the step-loop
    thread had used by then) and the id of every request added."""

    def __init__(self, engine, step_s: float = 0.005) -> None:
        self._engine = engine
        self.step_s = step_s
        self.steps: list[float] = []
        self.cpu: list[float] = []  # time.thread_time() on the step loop at each step
        self.added: list[str] = []
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, request_id, *args, **kwargs):
        self.added.append(request_id)
        return self._engine.add_request(request_id, *args, **kwargs)

    def step(self):
        with self.lock:
            self.steps.append(time.monotonic())
            self.cpu.append(time.thread_time())
        time.sleep(self.step_s)  # NOTE: simulated GPU time, not a wait for a condition
        return self._engine.step()


def test_a_huge_prompt_is_tokenized_off_the_step_loop_and_other_jobs_keep_stepping(start_worker, client, r, engine):
    from engine.models.tokenizer import load_tokenizer

    prompt = ("The quick brown fox jumps over the lazy dog. Zürich 数据 🚀 " * 20_000)[:1_000_000]
    assert len(prompt.encode()) < MAX_PROMPT_BYTES
    tokenizer = load_tokenizer(engine.tokenizer_path)
    tokenize_started = time.thread_time()
    num_tokens = len(tokenizer(prompt)["input_ids"])
    tokenize_cpu_s = time.thread_time() - tokenize_started  # the CPU it takes, whatever else the machine runs
    clock = StepClock(engine, step_s=0.01)  # the running job's 480 steps outlast the tokenization
    start_worker(clock)
    running = client.submit("Hello", sampling={"temperature": 0, "max_tokens": 480, "ignore_eos": True}, stream=True)
    wait_for(lambda: len(clock.steps) >= 5, what="the running job to step")
    submitted = time.monotonic()
    huge = client.submit(prompt, sampling=SHORT)
    with pytest.raises(JobFailed) as failed:
        client.result(huge, timeout=60)
    refused = time.monotonic()
    wait_for(lambda: clock.steps[-1] > refused, what="a step after the refusal")
    assert f"prompt is {num_tokens} tokens long" in failed.value.error and "max_model_len" in failed.value.error
    assert r.hget(KEYS.job(running), "status") == "running", "the running job should outlast the tokenization"
    # NOTE: the step loop's own CPU between steps, not the wall time: a machine under load stalls
    # the whole process for a while (no step then, but no CPU either), while tokenizing on the
    # step loop spends the tokenization's CPU between two of its steps.
    with clock.lock:
        times, cpu = list(clock.steps), list(clock.cpu)
    first = max(i for i, t in enumerate(times) if t < submitted)
    last = min(i for i, t in enumerate(times) if t > refused)
    cpu_gaps = [b - a for a, b in zip(cpu[first:last], cpu[first + 1:last + 1])]
    during = last - first - 1  # the steps taken between the submit and the refusal
    assert during > 10 and max(cpu_gaps) < tokenize_cpu_s / 4, (max(cpu_gaps), tokenize_cpu_s, during)
    assert huge not in clock.added  # refused without the step loop ever adding it
    assert client.result(running, timeout=60).usage.completion_tokens == 480
    assert_drained(r)


def test_a_worker_process_fails_each_hostile_entry_and_runs_every_good_one(spawn, redis_server, r):
    queue = KEYS.queue(QUEUE)
    hostile = {
        "p-nested": '{"v": 1, "id": "p-nested", "prompt": "x", "metadata": %s}' % ("[" * 1000 + "]" * 1000),
        "p-utf8": b'{"v": 1, "id": "p-utf8", "prompt": "\xc3\x28"}',
        "p-digits": '{"v": 1, "id": "p-digits", "prompt": "x", "priority": %s}' % ("1" * 5000),
        "p-nan": '{"v": 1, "id": "p-nan", "prompt": "x", "deadline": NaN}',
        "p-surrogate": '{"v": 1, "id": "p-surrogate", "prompt": "x", "metadata": {"t": "\\udc00"}}',
        "p-n": json.dumps({"v": 1, "id": "p-n", "prompt": "x", "sampling": {"n": 1_000_000}}),
    }
    good = [f"p-good-{i}" for i in range(10)]
    for raw, good_id in zip(hostile.values(), good):  # each hostile entry has a good one behind it
        r.xadd(queue, {"job": raw})
        r.xadd(queue, {"job": good_job(good_id)})
    for job_id in good[len(hostile):]:
        r.xadd(queue, {"job": good_job(job_id)})
    worker = spawn("--name", "hostile", redis_url=redis_server)
    for job_id in good:
        assert ended(r, job_id, timeout=60) == "done"
    letters = dead_letters(r)
    for job_id in hostile:
        assert ended(r, job_id) == "failed"
        assert letters[job_id]["error"] == assert_ended_once(r, job_id, "failed")["error"]
    assert_drained(r)
    assert worker.stop() == 0


def test_the_context_rule_holds_for_token_ids_and_measures_a_prompt_as_truncated(start_worker, client, r):
    """prompt + max_tokens must fit max_model_len (512 here) for a prompt of token ids as for text
    (one had run, cut off at the context's end); a text or chat prompt is measured as
    truncate_prompt_tokens keeps it (it had failed, measured whole)."""
    text = "hi " * 3000  # 9,000 tokens
    failing = {
        "ids-max": dict(prompt_token_ids=[5] * 500, sampling={"max_tokens": 100}),
        "ids-huge-max": dict(prompt_token_ids=[5] * 5, sampling={"max_tokens": 10**9}),
    }
    running = {
        "text-cut": (dict(prompt=text, sampling={"truncate_prompt_tokens": 10, "max_tokens": 2}), 10),
        "chat-cut": (dict(messages=[{"role": "user", "content": text}],
                          sampling={"truncate_prompt_tokens": 10, "max_tokens": 2}), 10),
        "ids-cut": (dict(prompt_token_ids=[5] * 3000, sampling={"truncate_prompt_tokens": -1, "max_tokens": 1}), 511),
    }
    ids = {name: client.submit(**fields) for name, fields in failing.items()}
    ids.update({name: client.submit(**fields) for name, (fields, _) in running.items()})
    start_worker()
    for name in failing:
        assert ended(r, ids[name]) == "failed"
        fields = assert_ended_once(r, ids[name], "failed")
        assert fields["error_code"] == "context_length_exceeded", fields
        assert "max_tokens" in fields["error"] and "exceeds max_model_len 512" in fields["error"], fields["error"]
    for name, (_, kept) in running.items():
        assert client.result(ids[name], timeout=30).usage.prompt_tokens == kept, name
    assert_drained(r)
