"""A streamed response: the job's token stream as OpenAI server-sent events.

Each token entry becomes one chunk (``text_completion`` or ``chat.completion.chunk``); with
``stream_options.include_usage`` a last chunk carries the usage; the stream ends with
``data: [DONE]``. A job that ends without a result (failed, cancelled, expired) ends the
stream with an ``error`` event, which the OpenAI SDK raises. A client that leaves mid-stream
cancels the job.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from gateway.errors import job_error, timeout_error, unexpected_error
from gateway.logprobs import chat_logprobs, completion_logprobs
from gateway.translate import OpenAIRequest, finish_reason, response_id, usage_of
from producers.deltas import CLOSING_REASONS
from producers.errors import JobError, JobNotFound, Timeout
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
    """Builds one request's chunks from its token deltas."""

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

    def delta(self, delta: TokenDelta) -> dict[str, Any] | None:
        """The chunk of one token entry, or None when it brings nothing to send."""
        reason = None if delta.finish_reason in CLOSING_REASONS else finish_reason(delta.finish_reason)
        if not delta.text and reason is None and not delta.token_ids:
            return None
        entries = getattr(delta, "logprobs", None) if self.logprobs else None
        choice: dict[str, Any] = {"index": delta.index}
        if self.chat and self.tools is not None:
            choice["delta"], reason = self._tool_delta(delta, reason)
            if not choice["delta"] and reason is None and not entries:
                return None  # held back: it may be part of a call
            choice["logprobs"] = chat_logprobs(entries) if entries else None
        elif self.chat:
            choice["delta"] = {"content": delta.text} if delta.text or reason is None else {}
            choice["logprobs"] = chat_logprobs(entries) if entries else None
        else:
            choice["text"] = delta.text
            choice["logprobs"] = self._completion_logprobs(delta.index, entries) if entries else None
        choice["finish_reason"] = reason
        return self._chunk([choice])

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

    def usage(self, result: Any) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": usage_of(result.model_dump())}


async def client_left(request: Any) -> None:
    """Returns when the client closes the connection (its body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class StreamRun:
    """One streamed request after its job was submitted: ``start`` waits for the first tokens
    (so a job that fails before any is answered with its own status), ``events()`` is the body."""

    def __init__(self, gw: "Gateway", req: OpenAIRequest, job_id: str, tenant: "Tenant | None",
                 started: float, timeout: float) -> None:
        self.gw = gw
        self.req = req
        self.job_id = job_id
        self.tenant = tenant  # counted against its outstanding limit until the stream ends
        self.started = started
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.batches = gw.client.stream_delta_batches(job_id, timeout=timeout, idle_check_s=IDLE_CHECK_S)
        self.first: list[TokenDelta] | None = None

    async def start(self, request: Any) -> bool:
        """Wait for the job's first tokens; False if the client left first (its job is cancelled).

        Raises the ``APIError`` of a job that ended without any (400 for ``invalid_job`` and
        ``context_length_exceeded``, ...), or 504 when the time runs out (the job cancelled).
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
            in_background(self._cancel())
            return False
        try:
            self.first = first.result()
        except Timeout:
            in_background(self._cancel())  # NOTE: the 504 does not wait for it
            raise timeout_error(self.timeout) from None
        except (JobError, JobNotFound) as exc:
            raise job_error(exc, self.req.endpoint) from None
        return True

    async def _first_tokens(self) -> list[TokenDelta] | None:
        batch = await anext(self.batches, None)
        # a job that ends without a token writes only its closing entry: read on to its error
        while batch is not None and all(d.finish_reason in CLOSING_REASONS and not d.token_ids for d in batch):
            batch = await anext(self.batches, None)
        return batch

    async def _all_batches(self) -> AsyncIterator[list[TokenDelta]]:
        if self.first is not None:
            yield self.first
            async for batch in self.batches:
                yield batch

    async def events(self) -> AsyncIterator[bytes]:
        gw, endpoint = self.gw, self.req.endpoint
        chunks = Chunks(self.req, self.job_id)
        ended, status, first = False, 200, True
        try:
            for chunk in chunks.opening():
                yield event(chunk)
            try:
                async for batch in self._all_batches():
                    out = [event(chunk) for delta in merged(batch) if (chunk := chunks.delta(delta)) is not None]
                    if not out:
                        continue
                    if first:
                        gw.metrics.ttft.labels(endpoint).observe(time.perf_counter() - self.started)
                        first = False
                    gw.metrics.tokens.labels(endpoint).inc(sum(len(d.token_ids) for d in batch))
                    yield b"".join(out)
                if self.req.include_usage:
                    yield event(chunks.usage(await gw.client.result(self.job_id, timeout=self._left())))
            except Timeout:
                in_background(self._cancel())
                status, error = 504, timeout_error(self.timeout)
                yield event(error.body())
            except (JobError, JobNotFound) as exc:
                error = job_error(exc, self.req.endpoint)
                status = error.status
                yield event(error.body())
            except Exception as exc:  # Redis gone for longer than the client rides out, say
                log.warning("gateway.stream_failed job=%s", self.job_id, exc_info=True)
                error = unexpected_error(exc)
                status = error.status
                yield event(error.body())
            ended = True
            yield DONE
        finally:
            # NOTE: closed here, not when it is collected: the shared reader stops reading its stream now
            await self.batches.aclose()
            if not ended:  # the client left (the stream was cancelled or closed): so goes the job
                status = 499
                gw.metrics.cancelled.labels(endpoint).inc()
                in_background(self._cancel())
            if self.tenant is not None:
                in_background(gw.outstanding.release(self.tenant, self.job_id))
            gw.metrics.in_progress.labels(endpoint).dec()
            gw.metrics.requests.labels(endpoint, str(status)).inc()
            gw.metrics.latency.labels(endpoint).observe(time.perf_counter() - self.started)

    def _left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def _cancel(self) -> None:
        try:
            await self.gw.client.cancel(self.job_id)
        except Exception:  # NOTE: best effort: the job still ends, at its worker's end
            pass

