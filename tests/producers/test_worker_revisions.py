"""The revision a job needs (``producers.protocol.revisions``), and the clients' refusal of a
job whose queue's live workers all speak an older one (``RevisionNotSpoken``), before it is
enqueued. The workers are heartbeats written as a worker of that revision writes them."""

from __future__ import annotations

import asyncio
import time

import pytest

from producers.aio import AsyncClient
from producers.client import Client
from producers.errors import InvalidJob, RevisionNotSpoken
from producers.jobs import make_job
from producers.protocol import Keys, Need, WorkerInfo, job_needs

K = Keys()
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize("job, reads, need", [
    (dict(prompt="x", sampling={"max_tokens": 3}), (), None),
    (dict(prompt="x", score={"continuations": [" a"]}), (), Need("1.2", "score")),
    (dict(prompt="x", sampling={"prompt_logprobs": 0}), (), Need("1.2", "sampling.prompt_logprobs")),
    (dict(messages=ASK, tools=TOOLS), (), Need("1.3", "tools")),
    (dict(messages=[*ASK, {"role": "assistant", "tool_calls": [CALL]}]), (), Need("1.3", "messages.1.tool_calls")),
    (dict(prompt="x", sampling={"prompt_logprobs": 0}), ("prompt_text",), Need("1.4", "prompt_text")),
])
def test_the_revision_a_job_needs_is_its_latest_fields(job, reads, need):
    assert job_needs(make_job(**job), reads) == need


def heartbeat(name: str, queues: list[str], protocol: str | None, *, alive: bool = True) -> str:
    """As a worker of ``protocol`` writes it (None: one from before 1.1, without the field)."""
    seen = time.time() - (0 if alive else 3600)
    return WorkerInfo(name=name, host="h", pid=1, queues=queues, model="m", started_at=seen, last_seen=seen,
                      stale_after_s=30, protocol=protocol).model_dump_json(exclude_none=True)


def test_a_job_the_queues_live_workers_cannot_read_is_refused_before_it_is_enqueued(redis_server, peer):
    peer.redis.hset(K.workers, mapping={"old": heartbeat("old", ["interactive", "bulk"], "1.2"),
                                        "gone": heartbeat("gone", ["bulk"], "1.4", alive=False),
                                        "new": heartbeat("new", ["fresh"], "1.4")})
    with Client(redis_server) as client:
        with pytest.raises(RevisionNotSpoken) as refused:
            client.submit(messages=ASK, tools=TOOLS)
        assert str(refused.value).startswith("tools: needs protocol revision 1.3, and the live workers of queue"
                                             " 'interactive' speak 1.2"), refused.value
        assert isinstance(refused.value, InvalidJob)
        assert (refused.value.field, refused.value.needed, refused.value.spoken) == ("tools", "1.3", "1.2")
        assert peer.redis.xlen(K.queue("interactive")) == 0
        client.submit("a plain job", queue="interactive")  # of 1.1's fields: any worker reads it
        client.submit(messages=ASK, tools=TOOLS, queue="fresh")  # a worker that speaks it
        client.submit(messages=ASK, tools=TOOLS, queue="nobody")  # no live worker: it waits for one
    peer.redis.hset(K.workers, "older", heartbeat("older", ["ancient"], None))
    with Client(redis_server, queue="ancient") as client:
        with pytest.raises(RevisionNotSpoken, match="^score: needs protocol revision 1.2, .* speak 1.0"):
            client.submit(prompt="x", score={"continuations": [" a"]})

    async def submit() -> None:
        async with AsyncClient(redis_server) as aio:
            with pytest.raises(RevisionNotSpoken, match="^tools: needs protocol revision 1.3"):
                await aio.submit(messages=ASK, tools=TOOLS)
            await aio.submit(messages=ASK, tools=TOOLS, queue="fresh")

    asyncio.run(submit())
    assert [peer.redis.xlen(K.queue(q)) for q in ("interactive", "fresh", "nobody", "ancient")] == [1, 2, 1, 0]
