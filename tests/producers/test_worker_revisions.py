"""The revision a job needs (``producers.protocol.revisions``), and the clients' refusal of a
job a live worker of its queue cannot read, as it speaks an older one (``RevisionNotSpoken``),
before it is enqueued. The workers are heartbeats written as a worker of that revision writes them."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from producers.aio import AsyncClient
from producers.bulk import Bulk
from producers.bulk_openai import OpenAIBulk
from producers.client import Client
from producers.errors import InvalidJob, RevisionNotSpoken
from producers.jobs import make_job
from producers.protocol import Keys, Need, WorkerInfo, job_needs
from tests.producers.peer import result_for

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


def test_submit_many_and_the_async_submits_of_built_jobs_refuse_it_naming_its_position(redis_server, peer):
    peer.redis.hset(K.workers, "old", heartbeat("old", ["interactive", "bulk"], "1.2"))
    plain, tooled = make_job("a plain job"), make_job(messages=ASK, tools=TOOLS)
    with Client(redis_server, queue="bulk") as client:
        with pytest.raises(RevisionNotSpoken, match="^job 1: tools: needs protocol revision 1.3, and the live"
                                                    " workers of queue 'bulk' speak 1.2") as refused:
            client.submit_many([plain, tooled])  # was: both enqueued, the second for the 1.2 worker to fail
        assert (refused.value.field, refused.value.reason.split(",")[0]) == ("tools", "needs protocol revision 1.3")
        assert client.submit_many([plain]) == [plain.id]

    async def submit() -> None:
        async with AsyncClient(redis_server) as aio:
            with pytest.raises(RevisionNotSpoken, match="^tools: needs protocol revision 1.3"):
                await aio.submit_job(tooled, "bulk")
            with pytest.raises(RevisionNotSpoken, match="^job 1: tools: "):
                await aio.submit_jobs([make_job("another"), tooled], "bulk")  # found before either is enqueued
            with pytest.raises(RevisionNotSpoken, match="^job 0: tools: "):
                await aio.submit_many([tooled], queue="interactive")

    asyncio.run(submit())
    assert [peer.redis.xlen(K.queue(q)) for q in ("bulk", "interactive")] == [1, 0]


def test_bulk_ends_a_row_the_live_workers_cannot_read_failed_and_runs_the_rest(redis_server, peer, tmp_path):
    peer.redis.hset(K.workers, "old", heartbeat("old", ["bulk"], "1.2"))
    peer.finish("plain-1", result=result_for("plain-1"))  # ended already: the run reads its end, submits nothing
    rows = [{"id": "plain-1", "prompt": "x"}, {"messages": ASK, "tools": TOOLS}, {"prompt": "y", "sampling": 5}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    reported: list[str] = []
    with Client(redis_server) as client:
        # NOTE: a timeout, so that without the check the run (its row waiting on a queue nobody reads) ends
        summary = Bulk(client, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False, timeout=5,
                       report=reported.append).run()
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["status"] for row in out] == ["done", "failed", "invalid"], out  # was: an abort, or a wait
    assert out[1]["error"].startswith("tools: needs protocol revision 1.3, and the live workers of queue 'bulk'"
                                      " speak 1.2"), out[1]
    assert (summary.complete, summary.done, summary.failed, summary.invalid) == (True, 1, 1, 1)
    assert any(text.startswith("line 2: job ") and "not submitted: tools: needs" in text for text in reported)
    assert peer.redis.xlen(K.queue("bulk")) == 0


def test_bulk_openai_answers_a_line_the_live_workers_cannot_read_as_the_endpoint_does(redis_server, peer, tmp_path):
    peer.redis.hset(K.workers, "old", heartbeat("old", ["bulk"], "1.2"))
    lines = [{"custom_id": "echo", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": ["a", "b"], "echo": True, "max_tokens": 1}},
             {"custom_id": "tools", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": "none"}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with Client(redis_server) as client:
        summary = OpenAIBulk(client, tmp_path / "in.jsonl", tmp_path / "out.jsonl", timeout=5).run()
    errors = {e["custom_id"]: e["error"] for e in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert {e["code"] for e in errors.values()} == {"unsupported_protocol_revision"}, errors
    assert errors["echo"]["message"].startswith("line 1: body.echo: needs protocol revision 1.4, and the live"
                                                " workers of queue 'bulk' speak 1.2"), errors
    assert errors["tools"]["message"].startswith("line 2: body.tools: needs protocol revision 1.3"), errors
    assert (summary.complete, summary.invalid) == (True, 2)
    assert peer.redis.xlen(K.queue("bulk")) == 0


def test_a_job_one_live_worker_of_its_queue_cannot_read_is_refused_as_that_worker_may_take_it(redis_server, peer):
    """A mixed fleet: any live worker of a queue may take its next job, so the oldest decides."""
    leaving = json.loads(heartbeat("leaving", ["bulk"], None))
    peer.redis.hset(K.workers, mapping={"new": heartbeat("new", ["interactive", "bulk"], "1.4"),
                                        "old": heartbeat("old", ["bulk"], "1.2"),
                                        "leaving": json.dumps({**leaving, "state": "draining"}),  # takes no job
                                        "foreign": "not a heartbeat"})
    tooled = make_job(messages=ASK, tools=TOOLS)
    with Client(redis_server, queue="bulk") as client:
        with pytest.raises(RevisionNotSpoken) as refused:
            client.submit(messages=ASK, tools=TOOLS)  # was: enqueued, for the 1.2 worker to fail if it took it
        assert str(refused.value).startswith(
            "tools: needs protocol revision 1.3, and 1 of the 2 live workers of queue 'bulk' speaks only 1.2 (the"
            " others up to 1.4; the queue is shared, so any of them may take the job)"), refused.value
        assert (refused.value.field, refused.value.needed, refused.value.spoken) == ("tools", "1.3", "1.2")
        client.submit(prompt="x", score={"continuations": [" a"]})  # 1.2: every live worker of bulk reads it
        client.submit(messages=ASK, tools=TOOLS, queue="interactive")  # the 1.4 worker alone reads interactive

    async def submit() -> None:
        async with AsyncClient(redis_server) as aio:
            with pytest.raises(RevisionNotSpoken, match=r"^job 0: tools: .* 1 of the 2 live workers .* only 1\.2"):
                await aio.submit_jobs([tooled], "bulk")
        # a caller that checked already (the gateway, from its model directory) turns the check off
        async with AsyncClient(redis_server, check_revisions=False) as unchecked:
            await unchecked.submit_job(tooled, "bulk")
            with pytest.raises(RevisionNotSpoken):
                await unchecked.check_revision(tooled, "bulk")  # asked for, it still checks

    asyncio.run(submit())
    assert [peer.redis.xlen(K.queue(q)) for q in ("bulk", "interactive")] == [2, 1]
    peer.redis.hdel(K.workers, "old")  # upgraded: the queue's live workers all speak 1.4
    with Client(redis_server, queue="bulk") as client:
        client.submit(messages=ASK, tools=TOOLS)
    assert peer.redis.xlen(K.queue("bulk")) == 3
