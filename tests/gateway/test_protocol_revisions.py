"""A rolling upgrade seen from the gateway: a request whose job needs a later protocol revision
than the live workers of its model speak is a 400 naming the field, never a job they refuse.

The older workers are heartbeats written as such a worker writes them (``hand_record``), on
queues nobody reads: a job the gateway accepts waits there (a 504 at its short timeout), while
a refused one is answered at once.
"""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import BOB, KEYS, hand_record, wait_for

# a model -> the protocol its one live worker speaks (None: a worker from before 1.1)
OLDER = {"on-1-2": "1.2", "on-1-3": "1.3", "before-1-1": None}
WAITED = {"x-sluiceway-timeout": "0.2"}  # an accepted job waits on a queue nobody reads: 504
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def older(stack):
    records = {f"{model}-1": hand_record(f"{model}-1", model, [model], alive=True, protocol=protocol)
               for model, protocol in OLDER.items()}
    stack.r.hset(KEYS.workers, mapping=records)
    wait_for(lambda: set(OLDER) <= set(listed(stack)), timeout=10, what="the older workers' models listed")
    yield stack
    stack.r.hdel(KEYS.workers, *records)
    wait_for(lambda: not set(OLDER) & set(listed(stack)), timeout=10, what="the older workers' models gone")


def listed(stack) -> list[str]:
    return [m.id for m in stack.gateway.client(BOB).models.list().data]


def post(stack, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(stack.gateway.url + path, json=body, timeout=30,
                      headers={"Authorization": f"Bearer {BOB}", **(headers or {})})


def refused(response: httpx.Response, param: str, needed: str, spoken: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_protocol_revision", error
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: needs protocol revision {needed}"), error
    assert f"speak {spoken}" in error["message"], error


def test_a_field_of_a_later_revision_than_the_live_workers_speak_is_a_400_naming_it(older):
    tools = post(older, "/v1/chat/completions", {"model": "on-1-2", "messages": ASK, "tools": [TOOL],
                                                 "tool_choice": "none"})
    refused(tools, "tools", "1.3", "1.2")  # was: a job the 1.2 worker failed naming an unknown field
    turn = [*ASK, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1",
                                                                 "content": "sunny"}]
    refused(post(older, "/v1/chat/completions", {"model": "on-1-2", "messages": turn}),
            "messages.1.tool_calls", "1.3", "1.2")
    refused(post(older, "/v1/chat/completions", {"model": "before-1-1", "messages": ASK, "tools": [TOOL],
                                                 "tool_choice": "none"}), "tools", "1.3", "1.0")
    assert older.r.xlen(KEYS.queue("on-1-2")) == 0  # nothing refused was enqueued
    # a job of the workers' revision is theirs, as before
    assert post(older, "/v1/chat/completions", {"model": "on-1-2", "messages": ASK}, WAITED).status_code == 504


@pytest.mark.parametrize("stream", [False, True])
def test_an_echo_to_workers_before_1_4_is_a_400_not_a_500(older, stream):
    body = {"model": "on-1-3", "prompt": "Hello", "max_tokens": 2, "echo": True, "stream": stream}
    refused(post(older, "/v1/completions", body), "echo", "1.4", "1.3")
    plain = {**body, "echo": False}
    assert post(older, "/v1/completions", plain, WAITED).status_code == 504  # accepted: it waits on the queue
