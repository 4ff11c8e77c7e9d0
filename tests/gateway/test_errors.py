"""Every error status as the OpenAI SDK expects it, tenants, and a client that leaves."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from producers.client import Client
from producers.protocol import Keys
from tests.gateway.conftest import ALICE, BOB, MAX_BACKLOG, MODEL, wait_for
from tests.gateway.test_openai import PROMPT, sync_client

KEYS = Keys()
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


def envelope(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def job_id_of(response_id: str) -> str:
    return response_id.split("-", 1)[1]


def test_invalid_input_is_400_naming_the_field_before_anything_is_enqueued(stack):
    client = sync_client(stack)
    before = stack.r.xlen(KEYS.queue("interactive"))
    cases = [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(n=0), "n"),
             (dict(extra_body={"bogus": 1}), "bogus"), (dict(logprobs=99), "logprobs"),
             (dict(extra_body={"top_k": "five"}), "top_k")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **kwargs)
        error = envelope(caught.value)
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert param in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert envelope(caught.value)["param"] == "messages.0.role"
    reply = httpx.post(stack.gateway.url + "/v1/completions", content=b"{not json",
                       headers={"Authorization": f"Bearer {ALICE}"})
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    assert stack.r.xlen(KEYS.queue("interactive")) == before


def test_what_only_the_worker_can_check_is_400_too(stack):
    with pytest.raises(openai.BadRequestError) as caught:  # the worker knows the context length
        sync_client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000)
    error = envelope(caught.value)
    assert error["code"] == "context_length_exceeded" and "max_model_len" in error["message"]


def test_missing_or_wrong_api_key_is_401(stack):
    with pytest.raises(openai.AuthenticationError) as caught:
        sync_client(stack, key="wrong").models.list()
    assert envelope(caught.value)["code"] == "invalid_api_key"
    missing = httpx.post(stack.gateway.url + "/v1/chat/completions", json={"model": MODEL})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"


def test_unknown_model_is_404_and_a_model_without_live_workers_503(stack):
    client = sync_client(stack)
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert envelope(caught.value)["code"] == "model_not_found"
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model="gone", prompt=PROMPT)
    assert caught.value.status_code == 503 and envelope(caught.value)["code"] == "model_unavailable"


def test_a_backlog_over_the_limit_is_429(stack):
    with Client(stack.redis_url, queue="parked") as producer:
        ids = producer.submit_many({"prompt": "waiting"} for _ in range(MAX_BACKLOG + 1))
        try:
            with pytest.raises(openai.RateLimitError) as caught:
                sync_client(stack).completions.create(model="parked", prompt=PROMPT)
            assert envelope(caught.value)["code"] == "backlog_full"
        finally:
            for job_id in ids:
                producer.cancel(job_id)
    assert stack.r.xlen(KEYS.queue("parked")) == 0


def test_a_request_past_its_timeout_is_504_and_its_job_cancelled(stack):
    with pytest.raises(openai.APIStatusError) as caught:
        sync_client(stack).completions.create(model="parked", prompt=PROMPT,
                                              extra_headers={"X-Sluiceway-Timeout": "0.3"})
    assert caught.value.status_code == 504 and envelope(caught.value)["code"] == "timeout"
    assert stack.r.xlen(KEYS.queue("parked")) == 0  # the queued job was cancelled, its entry gone


def stream_open(stack, key: str, model: str, **body) -> httpx.Response:
    """A streamed request opened and left open (its first bytes read)."""
    client = httpx.Client(base_url=stack.gateway.url, timeout=60, headers={"Authorization": f"Bearer {key}"})
    request = client.build_request("POST", "/v1/completions",
                                   json={"model": model, "prompt": PROMPT, "stream": True, **body})
    return client.send(request, stream=True)


def test_a_tenant_over_its_outstanding_limit_is_429_and_others_go_on(stack):
    held = [stream_open(stack, ALICE, "parked") for _ in range(2)]  # alice may have two
    try:
        assert [r.status_code for r in held] == [200, 200]
        with pytest.raises(openai.RateLimitError) as caught:
            sync_client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert envelope(caught.value)["code"] == "too_many_outstanding_requests"
        assert sync_client(stack, key=BOB).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices
    finally:
        for reply in held:
            reply.close()
    # the closed streams gave their places back (and cancelled their jobs)
    wait_for(lambda: stack.r.zcard(KEYS.outstanding("alice")) == 0, timeout=20, what="alice's places back")
    assert sync_client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices


def test_a_client_that_leaves_mid_stream_cancels_its_job(stack):
    reply = stream_open(stack, BOB, MODEL, **LONG)
    lines = reply.iter_lines()
    first = json.loads(next(line for line in lines if line.startswith("data: ")).removeprefix("data: "))
    job_id = job_id_of(first["id"])
    assert stack.r.hget(KEYS.job(job_id), "status") == "running"
    reply.close()
    wait_for(lambda: stack.r.hget(KEYS.job(job_id), "status") == "cancelled", timeout=30, what="the job cancelled")
    tokens = sum(len(json.loads(f["token_ids"])) for _, f in stack.r.xrange(KEYS.tokens(job_id)))
    assert tokens < LONG["max_tokens"]


def test_jobs_carry_their_tenant_and_answers_go_to_their_own_caller(stack):
    alice = sync_client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, user="a")
    bob = sync_client(stack, key=BOB).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    results = {name: json.loads(stack.r.hget(KEYS.job(job_id_of(reply.id)), "result"))
               for name, reply in (("alice", alice), ("bob", bob))}
    assert {name: r["metadata"]["tenant"] for name, r in results.items()} == {"alice": "alice", "bob": "bob"}
    assert alice.id != bob.id and len(job_id_of(alice.id)) == 32  # unguessable ids
