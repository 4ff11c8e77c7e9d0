"""A stream outlives its worker's kill -9 (a tool call's too); many concurrent streams lose nothing."""

from __future__ import annotations

import asyncio
import json
import signal

import openai

from producers.protocol import Keys
from tests.gateway.conftest import BOB, MODEL, wait_for
from tests.gateway.test_errors import job_id_of
from tests.gateway.test_openai import PROMPT, greedy, sync_client
from tests.gateway.test_tools import ASK, TOOLS

KEYS = Keys()
CLIENTS = 256
LONG = 400  # tokens: enough that the kill lands while the job runs
SAYING = "Let me look that up for you. " * 12  # ~290 tokens of the tiny tokenizer before the call
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def test_a_stream_goes_on_through_kill_9_of_its_worker_with_every_token_once(any_stack, offline):
    stack = any_stack
    # a chat whose answer (forced, as in test_tools) is a tool call after long text, killed mid-text too
    tools = iter(sync_client(stack, key=BOB).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=400, temperature=0, stream=True,
        extra_body={"structured_outputs": {"choice": [SAYING + CALL]}}))
    tool_first = next(tools)
    # and a batch of two prompts, their chunks interleaved (each its own job, each stream read by offset)
    pair = [PROMPT, PROMPT + " again"]
    batched = iter(sync_client(stack, key=BOB).completions.create(
        model=MODEL, prompt=pair, max_tokens=LONG, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    batched_first = next(batched)
    stream = sync_client(stack, key=BOB).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    job_id = job_id_of(first.id)
    stack.worker.stop(signal.SIGKILL)
    assert stack.r.hget(stack.keys.job(job_id), "status") == "running", "the kill should land while the job runs"
    stack.restart_worker()  # the same name: it takes its own unacknowledged entries back first
    rest = list(chunks)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
    assert text == offline.generate([PROMPT], greedy(LONG), use_tqdm=False)[0].outputs[0].text
    assert rest[-1].usage.completion_tokens == LONG
    assert stack.r.hget(stack.keys.job(job_id), "attempts") == "2"
    deltas = [c.choices[0].delta for c in [tool_first, *tools] if c.choices]
    assert "".join(d.content or "" for d in deltas) == SAYING  # every character once, the call's held back
    first, *fragments = [e for d in deltas for e in d.tool_calls or []]  # the call, its arguments as they came
    assert first.function.name == "get_weather" and {e.index for e in [first, *fragments]} == {0}
    arguments = "".join(e.function.arguments for e in [first, *fragments])
    assert arguments == '{"city": "Paris", "unit": "celsius"}'  # every character once
    assert stack.r.hget(stack.keys.job(job_id_of(tool_first.id)), "attempts") == "2"
    assert stack.r.hget(stack.keys.job(job_id_of(batched_first.id)), "attempts") == "2"
    texts = {0: "", 1: ""}
    for chunk in [batched_first, *batched]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [o.outputs[0].text for o in offline.generate(pair, greedy(LONG), use_tqdm=False)]
    wait_for(lambda: MODEL in [m.id for m in sync_client(stack).models.list().data], timeout=60,
             what="the restarted worker serving")


def test_256_concurrent_streams_complete_with_nothing_lost(stack):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"client {i} says", max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, job_id, usage = "", None, None
        async for chunk in stream:
            job_id = job_id_of(chunk.id)
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return job_id, text, usage.completion_tokens

    async def run() -> list[tuple[str, str, int]]:
        async with openai.AsyncOpenAI(base_url=stack.gateway.url + "/v1", api_key=BOB, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(CLIENTS)))

    answers = asyncio.run(run())
    assert len({job_id for job_id, _, _ in answers}) == CLIENTS
    for job_id, text, tokens in answers:
        result = json.loads(stack.r.hget(KEYS.job(job_id), "result"))
        assert tokens == 4 and text == result["text"]
