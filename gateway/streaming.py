"""A streamed response: the jobs' token streams as OpenAI server-sent events.

Each token entry becomes one chunk (``text_completion`` or ``chat.completion.chunk``); the
entries of a completions request's several prompts (one job each) come as they arrive, each
chunk's ``index`` its choice's (prompt * n + completion); an echo's first chunk of a choice
starts with the prompt. With ``stream_options.include_usage`` a last chunk carries the usage
of them all; the stream ends with ``data: [DONE]``. A job that ends without a result
(failed, cancelled, expired) ends the stream with an ``error`` event, which the OpenAI SDK
raises, and the request's other jobs are cancelled. A client that leaves mid-stream cancels
them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import TYPE_CHECKING, Any

from gateway.errors import job_error, timeout_error, unexpected_error
from gateway.logprobs import chat_logprobs, completion_logprobs
from gateway.translate import OpenAIRequest, finish_reason, response_id, usage_of
from producers.deltas import CLOSING_REASONS
from producers.errors import JobError, JobNotFound, Timeout
from producers.openai_responses import NO_PROMPT, echoed_prompt
from producers.openai_tools import TOOLS, ToolDeltas
from producers.openai_tools import finish_reason as tool_finish_reason
from producers.protocol import TokenDelta

if TYPE_CHECKING:
    from gateway.state import Gateway
    from gateway.tenants import Tenant

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
# NOTE: every end of a streamed job writes a closing entry to its token stream, so a silent
# stream needs no look at the job hash every second; of 1,024 streams most wait queued, and
# each look is a Redis call the gateway's one thread pays for.
IDLE_CHECK_S = 5.0
_background: set[asyncio.Task] = set()  # cancels and releases that outlive their (cancelled) stream


def in_background(coro: Any) -> None:
    """Run ``coro`` as a task of its own, outside the (possibly cancelled) request's scope, so a
    cancel that rides a Redis outage (up to the client's window) holds up no response."""
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


def cancel_jobs(gw: "Gateway", job_ids: list[str]) -> None:
    """Cancel each of a request's jobs beside the response (``in_background``)."""
    for job_id in job_ids:
        in_background(cancel_job(gw, job_id))


async def cancel_job(gw: "Gateway", job_id: str) -> None:
    try:
        await gw.client.cancel(job_id)
    except Exception:  # NOTE: best effort: the job still ends (done, or at its worker's end)
        log.warning("gateway.cancel_failed job=%s", job_id, exc_info=True)


async def all_of(awaitables: Iterable[Awaitable[Any]]) -> list[Any]:
    """Every result, in order; the first to raise raises at once, and the others are cancelled
    (one request's jobs: their streams' first tokens)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def merged(batch: list[TokenDelta]) -> list[TokenDelta]:
    """The deltas that arrived together, one per completion (in order of first arrival).

    NOTE: a stream that fell behind its worker answers what piled up in one chunk per
    completion: fewer, larger chunks are what lets one gateway process keep up with a batch
    of hundreds of streams; a stream that keeps up gets one chunk per token entry.
    """
    if len(batch) == 1:
        return batch
    by_index: dict[int, TokenDelta] = {}
    for delta in batch:
        have = by_index.get(delta.index)
        if have is None:
            by_index[delta.index] = delta
            continue
        update: dict[str, Any] = {"text": have.text + delta.text, "token_ids": have.token_ids + delta.token_ids,
                                  "finish_reason": delta.finish_reason or have.finish_reason}
        logprobs = getattr(have, "logprobs", None), getattr(delta, "logprobs", None)
        if logprobs[0] is not None or logprobs[1] is not None:
            update["logprobs"] = (logprobs[0] or []) + (logprobs[1] or [])
        by_index[delta.index] = have.model_copy(update=update)
    return list(by_index.values())


class Chunks:
    """Builds one request's chunks from its jobs' token deltas."""

    def __init__(self, req: OpenAIRequest, job_id: str) -> None:
        self.req = req
        self.chat = req.endpoint == "chat"
        meta = req.job["metadata"]["gateway"]
        self.head = {"id": response_id(req.endpoint, job_id),
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": meta["created"], "model": req.model}
        self.logprobs = meta.get("logprobs") is not None
        self.text_offset: dict[int, int] = {}  # completions: characters of the tokens sent, per choice
        self.tools = meta.get(TOOLS)  # a chat with tools: its answer's calls are read as it streams
        self.tool_deltas: dict[int, ToolDeltas] = {}  # per choice
        self.n = req.job["sampling"].get("n", 1)  # choices per job
        self.echo = meta.get("echo")  # completions: "prompt+completion", or "prompt" alone (max_tokens 0)
        self.prompts: dict[int, tuple[str, list[dict[str, Any]]]] = {}  # echo: each job's prompt, once it came
        self.echoed: set[int] = set()  # echo: the choices whose prompt went out
        self.held: dict[int, list[TokenDelta]] = {}  # echo: a job's entries that came before its prompt

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self.head, "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def opening(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant's role, one chunk per choice."""
        if not self.chat:
            return []
        n = self.req.job["sampling"].get("n", 1)
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(n)]

    def take(self, job: int, batch: list[TokenDelta]) -> list[dict[str, Any]]:
        """The chunks of one job's entries that arrived together (``job``: its prompt's place)."""
        deltas = merged(batch)
        if self.echo:
            deltas = self._after_prompt(job, deltas)
        return [chunk for delta in deltas if (chunk := self.delta(delta, job)) is not None]

    def _after_prompt(self, job: int, deltas: list[TokenDelta]) -> list[TokenDelta]:
        """Echo: a job's entries once its prompt has come (on completion 0's first entry, protocol
        1.4); another completion's entries that came first wait for it."""
        if job not in self.prompts:
            carrier = next((d for d in deltas if d.prompt_text is not None), None)
            if carrier is None:
                self.held.setdefault(job, []).extend(deltas)
                return []
            self.prompts[job] = echoed_prompt(carrier.model_dump())
        return [*self.held.pop(job, []), *deltas]

    def finish(self) -> None:
        """Raises when an echo's prompt never came (a worker older than protocol 1.4)."""
        if self.held:
            raise ValueError(NO_PROMPT)

    def delta(self, delta: TokenDelta, job: int = 0) -> dict[str, Any] | None:
        """The chunk of one token entry, or None when it brings nothing to send."""
        reason = None if delta.finish_reason in CLOSING_REASONS else finish_reason(delta.finish_reason)
        if not delta.text and reason is None and not delta.token_ids:
            return None
        entries = getattr(delta, "logprobs", None) if self.logprobs else None
        index = job * self.n + delta.index
        choice: dict[str, Any] = {"index": index}
        if self.chat and self.tools is not None:
            choice["delta"], reason = self._tool_delta(delta, reason)
            if not choice["delta"] and reason is None and not entries:
                return None  # held back: it may be part of a call
            choice["logprobs"] = chat_logprobs(entries) if entries else None
        elif self.chat:
            choice["delta"] = {"content": delta.text} if delta.text or reason is None else {}
            choice["logprobs"] = chat_logprobs(entries) if entries else None
        elif self.echo:
            choice["text"], entries = self._echoed(job, index, delta.text, entries)
            choice["logprobs"] = self._completion_logprobs(index, entries) if entries else None
        else:
            choice["text"] = delta.text
            choice["logprobs"] = self._completion_logprobs(index, entries) if entries else None
        choice["finish_reason"] = reason
        return self._chunk([choice])

    def _echoed(self, job: int, index: int, text: str, entries: list[Any] | None) -> tuple[str, list[Any] | None]:
        """An echo's choice: its first chunk starts with the prompt (and its logprobs); with
        ``max_tokens`` 0 the prompt alone, the one token generated never shown."""
        alone = self.echo == "prompt"
        if index in self.echoed:
            return ("", None) if alone else (text, entries)
        self.echoed.add(index)
        prompt_text, prompt_entries = self.prompts[job]
        if alone:
            return prompt_text, prompt_entries if self.logprobs else None
        return prompt_text + text, [*prompt_entries, *(entries or [])] if self.logprobs else None

    def _tool_delta(self, delta: TokenDelta, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A chat with tools: the ``delta`` its text lets go (content, or ``tool_calls`` entries with
        their index, id, name and arguments) and, at its end, ``tool_calls`` for an answer of calls."""
        reader = self.tool_deltas.setdefault(delta.index, ToolDeltas(self.tools))
        fields = reader.feed(delta.text)
        if reason is None:
            return fields, None
        for key, value in reader.finish().items():
            fields[key] = fields.get(key, type(value)()) + value  # content joins; tool_calls add up
        return fields, tool_finish_reason(reason, reader.called, reader.mode)

    def _completion_logprobs(self, index: int, entries: list[Any]) -> dict[str, Any]:
        # NOTE: offsets count the tokens' own text, as the whole response's do: a chunk's text
        # lags its tokens (a partial character, or what might begin a stop string), so the
        # text sent so far falls short
        offset = self.text_offset.get(index, 0)
        logprobs = completion_logprobs(entries, offset)
        self.text_offset[index] = offset + sum(len(token) for token in logprobs["tokens"])
        return logprobs

    def usage(self, results: list[Any]) -> dict[str, Any]:
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for result in results:
            for name, count in usage_of(result.model_dump()).items():
                usage[name] += count
        return {**self.head, "choices": [], "usage": usage}


async def client_left(request: Any) -> None:
    """Returns when the client closes the connection (its body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class StreamRun:
    """One streamed request after its jobs were submitted: ``start`` waits for each job's first
    tokens (so a job that fails before any is answered with its own status), ``events()`` is the body."""

    def __init__(self, gw: "Gateway", req: OpenAIRequest, job_ids: list[str], tenant: "Tenant | None",
                 started: float, timeout: float) -> None:
        self.gw = gw
        self.req = req
        self.job_ids = job_ids
        self.tenant = tenant  # counted against its outstanding limit until the stream ends
        self.started = started
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.batches = [gw.client.stream_delta_batches(job_id, timeout=timeout, idle_check_s=IDLE_CHECK_S)
                        for job_id in job_ids]
        self.first: list[list[TokenDelta] | None] = []

    async def start(self, request: Any) -> bool:
        """Wait for every job's first tokens; False if the client left first (the jobs are cancelled).

        Raises the ``APIError`` of a job that ended without any (400 for ``invalid_job`` and
        ``context_length_exceeded``, ...; the other jobs cancelled), or 504 when the time runs
        out (the jobs cancelled).
        """
        first = asyncio.ensure_future(self._first_tokens())
        left = asyncio.ensure_future(client_left(request))
        try:
            await asyncio.wait((first, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not first.done():
                first.cancel()
        if not first.done() or first.cancelled():
            self._cancel()
            return False
        try:
            self.first = first.result()
        except Timeout:
            self._cancel()  # NOTE: the 504 does not wait for it
            raise timeout_error(self.timeout) from None
        except (JobError, JobNotFound) as exc:
            if len(self.job_ids) > 1:
                self._cancel()
            raise job_error(exc, self.req.endpoint) from None
        return True

    async def _first_tokens(self) -> list[list[TokenDelta] | None]:
        return await all_of(_first_batch(batches) for batches in self.batches)

    async def _all_batches(self) -> AsyncIterator[tuple[int, list[TokenDelta]]]:
        """``(job, batch)``: each job's first batch, then every job's batches as they arrive."""
        for job, batch in enumerate(self.first):
            if batch is not None:
                yield job, batch
        if len(self.batches) == 1:
            async for batch in self.batches[0]:
                yield 0, batch
            return
        async with contextlib.aclosing(interleaved(self.batches)) as items:
            async for job, batch in items:
                yield job, batch

    async def events(self) -> AsyncIterator[bytes]:
        gw, endpoint = self.gw, self.req.endpoint
        chunks = Chunks(self.req, self.job_ids[0])
        batches = self._all_batches()
        ended, status, first = False, 200, True
        try:
            for chunk in chunks.opening():
                yield event(chunk)
            try:
                async for job, batch in batches:
                    out = [event(chunk) for chunk in chunks.take(job, batch)]
                    if not out:
                        continue
                    if first:
                        gw.metrics.ttft.labels(endpoint).observe(time.perf_counter() - self.started)
                        first = False
                    gw.metrics.tokens.labels(endpoint).inc(sum(len(d.token_ids) for d in batch))
                    yield b"".join(out)
                chunks.finish()
                if self.req.include_usage:
                    yield event(chunks.usage([await gw.client.result(job_id, timeout=self._left())
                                              for job_id in self.job_ids]))
            except Timeout:
                self._cancel()
                status, error = 504, timeout_error(self.timeout)
                yield event(error.body())
            except (JobError, JobNotFound) as exc:
                if len(self.job_ids) > 1:
                    self._cancel()
                error = job_error(exc, self.req.endpoint)
                status = error.status
                yield event(error.body())
            except Exception as exc:  # Redis gone for longer than the client rides out, say
                log.warning("gateway.stream_failed job=%s", self.job_ids[0], exc_info=True)
                error = unexpected_error(exc)
                status = error.status
                yield event(error.body())
            ended = True
            yield DONE
        finally:
            # NOTE: closed here, not when they are collected: the shared reader stops reading their streams
            # now; the reads in flight first (a stream cannot be closed while a read runs in it)
            await batches.aclose()
            for stream in self.batches:
                await stream.aclose()
            if not ended:  # the client left (the stream was cancelled or closed): so go the jobs
                status = 499
                gw.metrics.cancelled.labels(endpoint).inc()
                self._cancel()
            if self.tenant is not None:
                in_background(gw.outstanding.release(self.tenant, self.job_ids[0]))
            gw.metrics.in_progress.labels(endpoint).dec()
            gw.metrics.requests.labels(endpoint, str(status)).inc()
            gw.metrics.latency.labels(endpoint).observe(time.perf_counter() - self.started)

    def _left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def _cancel(self) -> None:
        cancel_jobs(self.gw, self.job_ids)


async def _first_batch(batches: AsyncIterator[list[TokenDelta]]) -> list[TokenDelta] | None:
    """A job's first batch with tokens, or None when its stream ends without one."""
    batch = await anext(batches, None)
    # a job that ends without a token writes only its closing entry: read on to its error
    while batch is not None and all(d.finish_reason in CLOSING_REASONS and not d.token_ids for d in batch):
        batch = await anext(batches, None)
    return batch


_END = object()


async def interleaved(sources: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """``(i, item)`` from each of ``sources`` as its items come; the first error raises (the
    other reads are cancelled)."""

    async def next_of(i: int) -> tuple[int, Any]:
        return i, await anext(sources[i], _END)

    reads = {asyncio.ensure_future(next_of(i)) for i in range(len(sources))}
    try:
        while reads:
            done, reads = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in done:
                i, item = read.result()
                if item is not _END:
                    reads.add(asyncio.ensure_future(next_of(i)))
                    yield i, item
    finally:
        for read in reads:
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)  # NOTE: their sources stop running before they return
