"""Protocol 1.1 on the producer side: exact JSON types refused before enqueueing, and the
error code of an ended job read back as its own exception."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from producers.errors import (
    ContextLengthExceeded,
    InvalidJob,
    JobCancelled,
    JobExpired,
    JobFailed,
    MaxAttemptsExceeded,
    job_error,
)
from producers.jobs import make_job
from producers.protocol import ErrorCode, JobStatus, Keys, ProtocolError, parse_job

KEYS = Keys()


@pytest.mark.parametrize("kwargs, words", [
    (dict(stream="yes"), "stream: expected a boolean, got the string 'yes'"),
    (dict(stream=1), "stream: expected a boolean, got the integer 1"),
    (dict(priority="5"), "priority: expected an integer, got the string '5'"),
    (dict(priority=True), "priority: expected an integer, got a boolean True"),
    (dict(sampling={"stop": 5}), "sampling.stop: expected a string or an array of strings, got the integer 5"),
    (dict(sampling={"temperature": "0"}), "sampling.temperature: expected a number, got the string '0'"),
    (dict(sampling={"max_tokens": 4.0}), "sampling.max_tokens: expected an integer or null, got the number 4.0"),
    (dict(sampling={"stop_token_ids": [1, "2"]}), "sampling.stop_token_ids.1: expected an integer, got the string '2'"),
    (dict(sampling={"stop": ["a", None]}), "sampling.stop.1: expected a string, got null"),
    (dict(sampling={"top_p": 2}), "sampling.top_p: top_p must be in (0, 1], got 2"),
    (dict(sampling={"n": 10**6}), "sampling.n: 1000000 completions is over the limit of 128 (MAX_N)"),
    # were a TypeError / ValueError of dict() and a PydanticSerializationError when the job was written
    (dict(sampling=[1]), "sampling: expected an object, got an array"),
    (dict(sampling="temperature=0"), "sampling: expected an object, got the string 'temperature=0'"),
    (dict(metadata=[1]), "metadata: expected an object, got an array"),
    (dict(metadata={"row": object()}), "metadata: not JSON: Unable to serialize unknown type: <class 'object'>"),
])
def test_the_client_refuses_a_wrong_type_before_enqueueing(client, kwargs, words):
    with pytest.raises(InvalidJob) as info:
        client.submit("Hello", **kwargs)
    assert str(info.value) == words
    assert client.redis.dbsize() == 0


def test_a_missing_version_says_missing_and_a_million_bad_ids_are_reported_briefly():
    with pytest.raises(ProtocolError, match=r"^v: missing"):
        parse_job('{"id": "j-1", "prompt": "x"}')
    with pytest.raises(ProtocolError) as info:
        parse_job('{"v": 1, "id": "j-1", "prompt_token_ids": [' + ",".join(['"1"'] * 100_000) + "]}")
    assert str(info.value).endswith("and 99,995 more") and len(str(info.value)) < 500
    assert info.value.job_id == "j-1"


def test_sampling_params_refuse_a_stop_list_of_the_wrong_type_with_a_value_error():
    for bad in (dict(stop=5), dict(stop_token_ids="12"), dict(stop={"a": 1})):
        with pytest.raises(ValueError, match="must be a list"):
            SamplingParams(**bad)
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(stop=None).stop == []


def test_each_code_is_its_own_exception_and_an_unknown_code_is_a_plain_failure():
    assert type(job_error("a", "failed", "long", ErrorCode.CONTEXT_LENGTH_EXCEEDED)) is ContextLengthExceeded
    assert type(job_error("a", "failed", "gave up", "max_attempts_exceeded")) is MaxAttemptsExceeded
    assert type(job_error("a", "cancelled", "by a client", "cancelled")) is JobCancelled
    assert type(job_error("a", "expired", None, "expired")) is JobExpired
    future = job_error("a", "failed", "new", "gpu_on_fire")  # a code from a later revision
    assert type(future) is JobFailed and future.code == "gpu_on_fire"
    old = job_error("a", "failed", "no code", None)  # a worker from before 1.1
    assert type(old) is JobFailed and old.code is None
    contradiction = job_error("a", "expired", None, "engine_error")  # the status wins
    assert type(contradiction) is JobExpired and contradiction.code == "engine_error"
    rebuilt = ContextLengthExceeded(*job_error("a", "failed", "long", "context_length_exceeded").args)
    assert rebuilt.code == "context_length_exceeded" and str(rebuilt) == "job a failed [context_length_exceeded]: long"


def test_the_job_status_exposes_the_code_and_the_client_raises_it(client):
    client.redis.hset(KEYS.job("j-1"), mapping={"status": "failed", "error": "too long",
                                                "error_code": "context_length_exceeded"})
    assert client.status("j-1").error_code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    with pytest.raises(ContextLengthExceeded, match="too long"):
        client.result("j-1", timeout=1)
    client.redis.hset(KEYS.job("j-2"), mapping={"status": "failed", "error_code": "gpu_on_fire"})
    assert client.status("j-2").error_code == "gpu_on_fire"
    assert JobStatus.from_hash("j-3", {"status": "done"}).error_code is None


def test_a_job_seed_of_minus_one_is_no_seed_and_other_negatives_name_the_field():
    """vLLM's "no seed": the job carries null (what an older worker also takes)."""
    assert make_job("Hello", sampling={"seed": -1}).sampling["seed"] is None
    assert parse_job('{"v": 1, "id": "j-1", "prompt": "x", "sampling": {"seed": -1}}').sampling["seed"] is None
    with pytest.raises(InvalidJob) as info:
        make_job("Hello", sampling={"seed": -2})
    assert str(info.value) == "sampling.seed: seed must be -1 (no seed) or an integer >= 0, got -2"
