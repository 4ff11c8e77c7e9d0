"""Every token stream of a gateway process is read by one ``XREAD`` over all of them."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai

from producers.protocol import Keys
from tests.gateway.conftest import BOB, MODEL, wait_for
from tests.gateway.test_errors import job_id_of

KEYS = Keys()
CLIENTS = 32
TOKENS = 16


def _blocked_xread(stack) -> bool:
    return any(c["cmd"] == "xread" and "b" in c["flags"] for c in stack.r.client_list())


def test_concurrent_streams_share_one_xread_which_a_new_stream_wakes(stack):
    """32 streams of 16 tokens while a silent one (a queue nobody reads) holds the reader
    blocked: each stream starts at once (the block is ended for it, CLIENT UNBLOCK), every
    token arrives once, and the gateway reads them all with far fewer XREADs than one per
    token entry of each stream, which is what reading each stream on its own costs."""

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"reader {i} says", max_tokens=TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, job_id, usage = "", None, None
        async for chunk in stream:
            job_id = job_id_of(chunk.id)
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return job_id, text, usage.completion_tokens

    async def run() -> tuple[list[tuple[str, str, int]], float, dict]:
        headers = {"Authorization": f"Bearer {BOB}"}
        body = {"model": "parked", "prompt": "nobody reads this queue", "max_tokens": 4, "stream": True}
        parked_before = stack.r.xlen(KEYS.queue("parked"))
        async with httpx.AsyncClient(base_url=stack.gateway.url, headers=headers, timeout=120) as http, \
                openai.AsyncOpenAI(base_url=stack.gateway.url + "/v1", api_key=BOB, max_retries=0,
                                   timeout=120) as client:
            silent = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await asyncio.to_thread(wait_for, lambda: stack.r.xlen(KEYS.queue("parked")) > parked_before,
                                    timeout=30, what="the silent stream's job queued")
            await asyncio.to_thread(wait_for, lambda: _blocked_xread(stack), timeout=30,
                                    what="the gateway's XREAD blocked on the silent stream")
            stack.r.config_resetstat()
            started = time.monotonic()
            answers = await asyncio.gather(*(one(client, i) for i in range(CLIENTS)))
            elapsed = time.monotonic() - started
            stats = stack.r.info("commandstats")
            silent.cancel()  # the client leaves: the gateway cancels its job
            await asyncio.gather(silent, return_exceptions=True)
        return answers, elapsed, stats

    parked_before = stack.r.xlen(KEYS.queue("parked"))
    answers, elapsed, stats = asyncio.run(run())
    wait_for(lambda: stack.r.xlen(KEYS.queue("parked")) == parked_before, timeout=30,
             what="the silent stream's job cancelled when its client left")
    assert len({job_id for job_id, _, _ in answers}) == CLIENTS
    for job_id, text, tokens in answers:
        result = json.loads(stack.r.hget(KEYS.job(job_id), "result"))
        assert tokens == TOKENS and text == result["text"]
    xreads = stats.get("cmdstat_xread", {}).get("calls", 0)
    # NOTE: one read of its own at the end of each stream (what the reader had not fetched
    # when its result came), and the shared reads: about two a worker step
    assert xreads < CLIENTS * TOKENS / 4, f"{xreads} XREADs for {CLIENTS} streams of {TOKENS} tokens"
    # the reader blocks up to 60 s on the silent stream: a new stream that waited for that
    # block to end (no CLIENT UNBLOCK) would take that long
    assert elapsed < 30, f"the streams took {elapsed:.1f} s: a new stream waited for the blocked read"
