"""Protocol 1.1's strict input, through real workers: every field of the job and of its
sampling must have its exact JSON type, and garbage sent through the submit script still
ends the job its hash names. Also what a worker's heartbeat tells producers."""

from __future__ import annotations

import dataclasses
import json
import signal
import time

import pytest
import redis

from engine.sampling_params import SamplingParams
from producers.client import Client
from producers.errors import InvalidJobFailed
from producers.protocol import SUBMIT_SCRIPT, Keys, WorkerInfo, submit_keys
from tests.worker.conftest import CLIENT_KWARGS, pending_count, wait_for
from tests.worker.test_process import spawn  # noqa: F401  (a fixture)

KEYS = Keys()
QUEUE = "interactive"

# Each job field with a value of the wrong JSON type, and what the error must say about it.
BAD_JOB_FIELDS = {
    "stream": ("yes", "stream: expected a boolean, got the string 'yes'"),
    "priority": ("5", "priority: expected an integer, got the string '5'"),
    "priority-float": (5.0, "priority: expected an integer, got the number 5.0"),
    "deadline": ("soon", "deadline: expected a number, got the string 'soon'"),
    "metadata": ([1], "metadata: expected an object, got an array"),
    "sampling": ("greedy", "sampling: expected an object, got the string 'greedy'"),
    "prompt": (5, "prompt: expected a string, got the integer 5"),
    "prompt_token_ids": (["1"], "prompt_token_ids.0: expected an integer, got the string '1'"),
    "messages": ([{"role": "user", "content": 5}], "messages.0.content: expected a string, got the integer 5"),
    "v": ("1", "v: expected an integer, got the string '1'"),
    "v-bool": (True, "v: expected an integer, got a boolean True"),
}
# Each sampling field with a value of the wrong JSON type (every field of SamplingParams).
BAD_SAMPLING = {
    "n": "2", "temperature": "0.5", "top_p": "1", "top_k": 1.5, "min_p": "0", "presence_penalty": "0",
    "frequency_penalty": False, "repetition_penalty": "1", "seed": 1.5, "stop": 5, "stop_token_ids": "1",
    "ignore_eos": "no", "max_tokens": 2.0, "min_tokens": "0", "logprobs": True, "prompt_logprobs": "1", "skip_special_tokens": 1,
    "include_stop_str_in_output": "yes", "bad_words": 5, "logit_bias": "1", "allowed_token_ids": "1",
    "truncate_prompt_tokens": "2", "detokenize": 0, "spaces_between_special_tokens": "no", "extra_args": "x",
    "structured_outputs": "x",
}


def submit_raw(r: redis.Redis, job_id: str, raw: str, stream_flag: str = "0") -> None:
    r.eval(SUBMIT_SCRIPT, 5, *submit_keys(KEYS, job_id, QUEUE), raw, repr(time.time()), QUEUE, stream_flag)


def bad_job(job_id: str, name: str, value) -> str:
    job = {"v": 1, "id": job_id, "prompt": "Hello", "sampling": {"max_tokens": 2}}
    field = name.split("-")[0]
    if field in ("prompt_token_ids", "messages"):
        del job["prompt"]
    job[field] = value
    return json.dumps(job)


def failed_error(client: Client, r: redis.Redis, job_id: str) -> str:
    with pytest.raises(InvalidJobFailed) as info:
        client.result(job_id, timeout=30)
    fields = r.hgetall(KEYS.job(job_id))
    assert fields["status"] == "failed" and fields["error_code"] == "invalid_job"
    assert fields["error"] == info.value.error
    return fields["error"]


def test_every_field_of_a_wrong_json_type_fails_its_job_by_name(start_worker, client, r):
    assert set(BAD_SAMPLING) == {f.name for f in dataclasses.fields(SamplingParams)}  # a new field needs a case
    for name, (value, _) in BAD_JOB_FIELDS.items():
        submit_raw(r, f"job-{name}", bad_job(f"job-{name}", name, value), "1" if name == "stream" else "0")
    for name, value in BAD_SAMPLING.items():
        submit_raw(r, f"sampling-{name}", bad_job(f"sampling-{name}", "sampling", {name: value}))
    good = client.submit("Hello", sampling={"max_tokens": 2, "temperature": 1, "stop": "x"})  # 1 is a number
    start_worker()
    assert client.result(good, timeout=30).usage.completion_tokens <= 2
    for name, (_, words) in BAD_JOB_FIELDS.items():
        error = failed_error(client, r, f"job-{name}")
        assert error == f"invalid job: {words}", error
    for name, value in BAD_SAMPLING.items():
        error = failed_error(client, r, f"sampling-{name}")
        assert error.startswith(f"invalid job: sampling.{name}: expected "), error
        assert error.endswith(f" {value!r}"), error  # the value, as given
    # The "yes" job was not streamed: its hash said stream 1 and nothing was written there.
    assert r.xlen(KEYS.tokens("job-stream")) == 0
    wait_for(lambda: pending_count(r, QUEUE) == 0, what="the pending list to drain")


# The job values a producer may send through the submit script that no id can be read from.
GARBAGE = {
    "not-json": "this is not JSON",
    "truncated": '{"v": 1, "prompt": "no id before the cut',
    "id-number": '{"v": 1, "id": 17, "prompt": "x"}',
    "id-late": '{"v": 1, "metadata": {"pad": "' + "x" * 70_000 + '"}, "id": "id-late", "prompt": "x"',
    "other-id": '{"v": 1, "id": "someone-else", "prompt": "x"}',
    "empty": "",
}


def test_garbage_sent_through_the_submit_script_fails_the_hash_it_created(start_worker, client, r):
    for job_id, raw in GARBAGE.items():
        submit_raw(r, job_id, raw)
        assert r.hget(KEYS.job(job_id), "status") == "queued"
    start_worker()
    errors = {job_id: failed_error(client, r, job_id) for job_id in GARBAGE}
    letters = {fields["job_id"]: fields for _, fields in r.xrange(KEYS.dead)}
    for job_id, error in errors.items():
        assert letters[job_id]["error"] == error and letters[job_id]["error_code"] == "invalid_job"
    assert "'someone-else' is not the id the job was submitted under ('other-id')" in r.hget(
        KEYS.job("other-id"), "error")
    assert not r.exists(KEYS.job("someone-else"))  # the entry's own id is never started
    wait_for(lambda: pending_count(r, QUEUE) == 0, what="the pending list to drain")


def test_a_worker_process_advertises_its_protocol_and_result_ttl_and_ends_garbage(spawn, redis_server, r):
    submit_raw(r, "garbage-1", "{{{")
    worker = spawn("--name", "strict", "--result-ttl", "777", "--no-celery", redis_url=redis_server)
    with Client(redis_server, **CLIENT_KWARGS) as client:
        with pytest.raises(InvalidJobFailed):
            client.result("garbage-1", timeout=60)
        info = WorkerInfo.model_validate_json(wait_for(lambda: r.hget(KEYS.workers, "strict"), timeout=30))
        assert info.protocol == "1.4" and info.result_ttl_s == 777
        assert 0 < r.ttl(KEYS.job("garbage-1")) <= 777
    assert worker.stop(signal.SIGTERM) == 0


def test_ids_tool_names_and_token_id_keys_are_exact_where_python_is_lenient(start_worker, client, r):
    """A regex's ``$`` also matches before a final newline, and ``str.isdigit`` passes '²', '١' and
    5,000 digits: an entry of id 'nl\\n' has no id (dead-lettered unaddressed, no key made for it),
    and a tool named 'f\\n' or a logit_bias key of such digits fails its job by field."""
    queue = KEYS.queue(QUEUE)
    newline_entry = r.xadd(queue, {"job": json.dumps({"v": 1, "id": "nl\n", "prompt": "Hello"})})
    chat = [{"role": "user", "content": "x"}]
    bad = {
        "tool-nl": (dict(messages=chat, tools=[{"type": "function", "function": {"name": "f\n"}}]),
                    "tools.0.function.name: 'f\\n' is not a function name"),
        "bias-superscript": (dict(prompt="x", sampling={"logit_bias": {"²": 1}}),
                             "sampling.logit_bias: key '²' is not a token id"),
        "bias-arabic": (dict(prompt="x", sampling={"logit_bias": {"١": 1}}),  # int() had read it as token 1
                        "sampling.logit_bias: key '١' is not a token id"),
        "bias-digits": (dict(prompt="x", sampling={"logit_bias": {"1" * 5000: 1}}),
                        "(5,002 chars) is not a token id: expected 1 to 64 decimal digits 0-9 (MAX_INT_DIGITS)"),
    }
    for job_id, (fields, _) in bad.items():
        r.xadd(queue, {"job": json.dumps({"v": 1, "id": job_id, **fields})})
    good = client.submit("Hello", sampling={"max_tokens": 2, "logit_bias": {"7": 1.5}})
    start_worker()
    assert client.result(good, timeout=30).usage.completion_tokens <= 2
    for job_id, (_, words) in bad.items():
        assert words in failed_error(client, r, job_id)
    letter = next(fields for _, fields in r.xrange(KEYS.dead) if fields["entry_id"] == newline_entry)
    assert letter["job_id"] == "" and "id 'nl\\n' may hold only" in letter["error"]
    assert r.exists(KEYS.job("nl\n"), KEYS.done("nl\n")) == 0
    wait_for(lambda: pending_count(r, QUEUE) == 0, what="the pending list to drain")
