"""Structured outputs through a real worker and Redis: constrained jobs come back valid, and a
bad constraint fails its own job ``invalid_job`` naming the field while the rest run."""

from __future__ import annotations

import json

import pytest

from engine import SamplingParams, StructuredOutputsParams
from producers.errors import InvalidJob, InvalidJobFailed
from producers.protocol import ErrorCode, Keys
from tests.engine.structured_helpers import FLAG, GRADE, SLOW_SCHEMA, json_valid, regex_valid
from tests.worker.test_error_codes import assert_ended_with, submit_raw

KEYS = Keys()
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"


@pytest.fixture(scope="module")
def engine(make_engine):
    """The worker's engine: 8 sequences; a grammar that takes over a quarter of a second fails its job."""
    return make_engine(max_num_seqs=8, structured_outputs_timeout_s=0.25)


def sampling(**structured) -> dict:
    return {"temperature": 0, "max_tokens": 64, "structured_outputs": structured}


def test_constrained_jobs_are_valid_and_bad_ones_fail_alone(start_worker, client, r, engine):
    start_worker()
    only_eos = sorted(engine.eos_token_ids)[:1]
    good = {
        client.submit("Grade the following answer", sampling=sampling(json=GRADE)): json_valid(GRADE),
        client.submit("Queues hold jobs", sampling=sampling(json=json.dumps(FLAG))): json_valid(FLAG),
        client.submit("Email", sampling=sampling(regex=EMAIL)): regex_valid(EMAIL),
        client.submit("Pick", sampling=sampling(choice=["yes", "no"])): lambda t: t in ("yes", "no"),
        client.submit("Hello", sampling=SamplingParams(
            temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=FLAG))): json_valid(FLAG),
    }
    # what a producer in another language may send: shape errors fail at the worker's parse,
    # backend errors when the engine takes the job, a slow grammar when its time is up
    bad = {
        "bad-type": (sampling(json={"type": "object", "properties": {"a": {"type": "foo"}}}),
                     "sampling.structured_outputs.json.properties.a.type"),
        "bad-two": ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "sampling.structured_outputs"),
        "bad-regex": (sampling(regex="[a-z"), "structured_outputs.regex"),
        "bad-grammar": (sampling(grammar='root ::= "a" |'), "structured_outputs.grammar"),
        "bad-slow": (sampling(json=SLOW_SCHEMA),
                     "structured_outputs.json: the grammar did not compile within 0.25 s"),
        # the constraint and the sampling filters leave no token: failed, never a "stop" cut short
        "bad-dead-end": ({**sampling(choice=["yes", "no"]), "allowed_token_ids": only_eos},
                         "sampling.structured_outputs: at output token 0 the constraint allows no token"),
    }
    for job_id, (params, _) in bad.items():
        submit_raw(r, job_id, json.dumps({"v": 1, "id": job_id, "prompt": "Hi", "sampling": params}))
    finished = 0
    for job_id, check in good.items():
        result = client.result(job_id, timeout=60)
        out = result.outputs[0]
        if out.finish_reason == "stop":
            assert check(out.text), (job_id, out.text)
            finished += 1
    assert finished >= 3
    for job_id, (_, field) in bad.items():
        error = assert_ended_with(client, r, job_id, "failed", ErrorCode.INVALID_JOB, InvalidJobFailed)
        assert field in str(error), (job_id, str(error))


def test_the_client_refuses_a_bad_constraint_before_queueing(client, r):
    with pytest.raises(InvalidJob, match=r"sampling\.structured_outputs\.json\.uniqueItems"):
        client.submit("Hi", sampling=sampling(json={"type": "array", "uniqueItems": True}))
    with pytest.raises(ValueError, match=r"structured_outputs\.choice\.1"):
        client.submit("Hi", sampling=SamplingParams(structured_outputs={"choice": ["a", ""]}))
    assert r.xlen(KEYS.queue("interactive")) == 0


def test_streamed_constrained_job_rebuilds_its_text(start_worker, client):
    start_worker()
    job_id = client.submit("Grade", sampling=sampling(json=GRADE), stream=True)
    text = "".join(client.stream(job_id, timeout=60))
    result = client.result(job_id, timeout=60).outputs[0]
    assert text == result.text
    assert result.finish_reason == "stop" and json_valid(GRADE)(text), (result.finish_reason, text)
