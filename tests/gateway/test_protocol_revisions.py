"""A rolling upgrade seen from the gateway: a request whose job needs a later protocol revision
than the live workers of its model speak is a 400 naming the field, never a job they refuse.

The older workers are heartbeats written as such a worker writes them (``hand_record``), on
queues nobody reads: a job the gateway accepts waits there (a 504 at its short timeout), while
a refused one is answered at once.
"""

from __future__ import annotations

import asyncio
import io
import json
import re

import httpx
import pytest

from gateway import batch_feeder
from gateway.batch_service import BatchService
from gateway.batch_settings import BatchSettings
from gateway.models import ModelDirectory
from producers.connection import connect_async
from tests.gateway.conftest import BOB, KEYS, hand_record, wait_for
from tests.gateway.test_batch_feeder import BATCH_KEYS, add_batch, until

# a model -> the protocol its one live worker speaks (None: a worker from before 1.1)
OLDER = {"on-1-2": "1.2", "on-1-3": "1.3", "before-1-1": None}
# a model of a mixed fleet: a worker of 1.4 reads both its queues, one of 1.2 its bulk queue alone
SPLIT = {"split-new": (["split-interactive", "split-bulk"], "1.4"), "split-old": (["split-bulk"], "1.2")}
BULK = {"x-sluiceway-queue": "bulk"}
WAITED = {"x-sluiceway-timeout": "0.2"}  # an accepted job waits on a queue nobody reads: 504
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def older(stack):
    records = {f"{model}-1": hand_record(f"{model}-1", model, [model], alive=True, protocol=protocol)
               for model, protocol in OLDER.items()}
    records |= {name: hand_record(name, "split", queues, alive=True, protocol=protocol)
                for name, (queues, protocol) in SPLIT.items()}
    stack.r.hset(KEYS.workers, mapping=records)
    models = {*OLDER, "split"}
    wait_for(lambda: models <= set(listed(stack)), timeout=10, what="the older workers' models listed")
    yield stack
    stack.r.hdel(KEYS.workers, *records)
    wait_for(lambda: not models & set(listed(stack)), timeout=10, what="the older workers' models gone")


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
    assert re.search(rf"speaks?( only)? {re.escape(spoken)}\b", error["message"]), error


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


def test_a_queue_of_a_mixed_fleet_takes_only_what_its_oldest_live_worker_reads(older):
    """Any live worker of a queue may take its next job: a job for the 1.4 worker alone is refused
    on the queue the 1.2 worker reads too, and accepted on the one only the 1.4 worker reads."""
    chat = {"model": "split", "messages": ASK, "tools": [TOOL], "tool_choice": "none"}
    tools = post(older, "/v1/chat/completions", chat, {**BULK, **WAITED})
    refused(tools, "tools", "1.3", "1.2")  # was: a job the 1.2 worker failed, if it took it
    assert ("1 of the 2 live workers of model 'split''s queue 'split-bulk' speaks only 1.2 (the others up to"
            " 1.4; the queue is shared, so any of them may take the job)") in tools.json()["error"]["message"], tools.text
    echo = {"model": "split", "prompt": "Hello", "max_tokens": 2, "echo": True}
    refused(post(older, "/v1/completions", echo, {**BULK, **WAITED}), "echo", "1.4", "1.2")
    assert older.r.xlen(KEYS.queue("split-bulk")) == 0  # nothing refused was enqueued
    assert post(older, "/v1/chat/completions", chat, WAITED).status_code == 504  # interactive: the 1.4 worker's
    assert post(older, "/v1/completions", {**echo, "echo": False}, {**BULK, **WAITED}).status_code == 504


def test_the_gateway_reads_the_heartbeats_for_a_revision_once_in_its_model_directory(redis_server):
    """The gateway's client submits without a heartbeat read of its own (``check_revisions=False``):
    what the model directory's one read accepted is enqueued, and there is no second read to race
    it; even a job the directory would refuse, had anything skipped ``check_speaks``."""
    from gateway.errors import InvalidRequest
    from gateway.settings import GatewaySettings
    from gateway.state import Gateway
    from producers.jobs import make_job

    tooled = make_job(messages=ASK, tools=[TOOL])

    async def run() -> dict:
        gw = Gateway(GatewaySettings(redis=redis_server, models_refresh_seconds=60))
        try:
            await gw.client.redis.hset(KEYS.workers, mapping={
                name: hand_record(name, "split", queues, alive=True, protocol=protocol)
                for name, (queues, protocol) in SPLIT.items()})
            model = await gw.models.serving("split")
            with pytest.raises(InvalidRequest, match="^tools: needs protocol revision 1.3, and 1 of the 2 live"):
                model.check_speaks([tooled], model.queue("bulk"))
            model.check_speaks([tooled], model.queue("interactive"))
            await gw.client.redis.config_resetstat()
            await gw.client.submit_job(tooled, model.queue("interactive"))
            await gw.client.submit_jobs([make_job(messages=ASK, tools=[TOOL])], model.queue("bulk"))
            stats = await gw.client.redis.info("commandstats")
            assert [await gw.client.redis.xlen(KEYS.queue(q)) for q in ("split-interactive", "split-bulk")] == [1, 1]
            return stats
        finally:
            await gw.close()

    stats = asyncio.run(run())
    assert "cmdstat_hgetall" not in stats, stats  # was: the client's own read of the heartbeats


# a batch line's model -> its live workers' records, the queue its lines go to, what the refusal says
BATCH_FLEETS = {
    "on-1-3": ({"on-1-3-1": (["on-1-3"], "1.3")}, "on-1-3", "the live workers of model 'on-1-3''s queue 'on-1-3' speak 1.3"),
    # a mixed fleet: a line goes to the model's bulk queue, which the 1.2 worker reads too
    "split": (SPLIT, "split-bulk", "1 of the 2 live workers of model 'split''s queue 'split-bulk' speaks only 1.2"),
}


@pytest.mark.parametrize("model", BATCH_FLEETS)
def test_a_batch_line_the_live_workers_cannot_read_is_an_error_line_as_the_endpoint_answers(redis_server,
                                                                                             monkeypatch, model):
    """In process on its own Redis (``test_batch_feeder``'s way): no gateway process to start. In
    the mixed fleet a line the 1.4 worker alone reads is refused: the 1.2 one may take it."""
    monkeypatch.setattr(batch_feeder, "STOP_WAIT_S", 0.3)
    fleet, queue, says = BATCH_FLEETS[model]
    lines = [{"custom_id": "echo", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": ["Hello", "Hi"], "echo": True, "max_tokens": 1}},
             {"custom_id": "plain", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": "Hello", "max_tokens": 1}}]

    async def run() -> list[dict]:
        models = ModelDirectory(connect_async(redis_server, decode_responses=True), KEYS, 1.0)
        await models.redis.hset(KEYS.workers, mapping={
            name: hand_record(name, model, queues, alive=True, protocol=protocol)
            for name, (queues, protocol) in fleet.items()})
        service = BatchService(redis_server, KEYS.prefix, models, BatchSettings(poll_seconds=0.05))
        try:
            text = "".join(json.dumps(line) + "\n" for line in lines).encode()
            upload = await service.store.put_upload("alice", "in.jsonl", "batch", io.BytesIO(text))
            batch_id = await add_batch(service, "alice", upload["id"])
            await service.redis.hset(BATCH_KEYS.batch(batch_id), "endpoint", "/v1/completions")
            await service.start()

            async def fed() -> bool:  # the plain line's job waits on a queue nobody reads
                return await service.redis.hget(BATCH_KEYS.batch(batch_id), "cursor_line") == "2"

            await until(fed, timeout=5, what="both lines fed")
            assert await service.redis.xlen(KEYS.queue(queue)) == 1  # was 3: the echo's two prompts too
            return [json.loads(line) for line in await service.redis.lrange(BATCH_KEYS.errors(batch_id), 0, -1)]
        finally:
            await service.close()
            await models.redis.aclose()

    errors = asyncio.run(run())
    assert [e["custom_id"] for e in errors] == ["echo"], errors
    error = errors[0]["error"]
    assert error["code"] == "unsupported_protocol_revision" and errors[0]["response"] is None, error
    assert error["message"].startswith(f"line 1: body.echo: needs protocol revision 1.4, and {says}"), error
