"""The asyncio producer client: ``Client``'s API over ``redis.asyncio``.

    async with AsyncClient("redis://localhost:6379/0") as client:
        job_id = await client.submit("Hello", sampling={"max_tokens": 32}, stream=True)
        async for text in client.stream(job_id, timeout=60):
            print(text, end="")
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, TypeVar

from redis.exceptions import ResponseError

from engine.sampling_params import SamplingParams
from producers.aio_streams import SharedStreamReader, Tail
from producers.connection import check_cluster_layout, connect_async, connection_kwargs_of
from producers.deltas import ExactDeltas
from producers.scripting import register
from producers.errors import Timeout
from producers.jobs import (
    LIVE_STATUSES,
    OUTAGE_ERRORS,
    STREAM_IDLE_CHECK_S,
    Outage,
    ResultsWatch,
    is_unblocked,
    block_chunk,
    socket_timeout_of,
    block_ms,
    cancel_call,
    cancel_outcome,
    make_job,
    job_chunks,
    outcome,
    queue_name,
    remaining,
    status_of,
    submit_call,
    unfinished,
    wait_deadline,
    whole_result,
)
from producers.protocol import (
    DEFAULT_CANCEL_TTL_S,
    DEFAULT_PREFIX,
    CANCEL_SCRIPT,
    DEFAULT_RESULT_TTL_S,
    SUBMIT_SCRIPT,
    Job,
    JobField,
    JobResult,
    JobStatus,
    Keys,
    TokenDelta,
    job_needs,
)
from producers.worker_revisions import WorkerRevisions, needing

T = TypeVar("T")


class AsyncClient:
    """Protocol v1 over ``redis.asyncio``; see ``producers.client.Client`` for each method."""

    def __init__(
        self, url: str | None = None, prefix: str = DEFAULT_PREFIX, queue: str = "interactive", queue_shards: int = 0,
        shared_streams: bool = False, check_revisions: bool = True, **redis_kwargs: Any
    ) -> None:
        """``shared_streams``: every ``stream_delta_batches`` of this client reads through one
        ``XREAD`` over all their streams (``producers/aio_streams.py``), for a process that
        follows hundreds of streams at once (with ACLs it needs ``CLIENT ID`` and ``CLIENT UNBLOCK``
        too, or a new stream waits up to 50 ms); otherwise each reads its own on a connection of its own.
        On a cluster the shared reader sends one ``XREAD`` per hash slot of the streams followed.
        ``check_revisions=False``: the submits (``submit``, ``submit_job``, ``submit_jobs``,
        ``submit_many``) enqueue a job of a later protocol revision without reading the heartbeats
        (``producers.worker_revisions``), for a caller that checked it already from its own read of
        them (the gateway: ``gateway/models.py``); ``check_revision`` still checks when called."""
        self.keys = Keys(prefix, queue_shards)
        self.queue = queue_name(queue)
        self.redis = connect_async(url, decode_responses=True, **redis_kwargs)
        check_cluster_layout(self.redis, queue_shards)  # now, not as CROSSSLOT at the first submit
        self._submit_script = register(self.redis, SUBMIT_SCRIPT)
        self._cancel_script = register(self.redis, CANCEL_SCRIPT)
        self._revisions = WorkerRevisions()
        self.check_revisions = check_revisions
        self.socket_timeout = socket_timeout_of(connection_kwargs_of(self.redis))
        self.streams = SharedStreamReader(self.redis, self.socket_timeout) if shared_streams else None

    async def close(self) -> None:
        if self.streams is not None:
            await self.streams.close()
        await self.redis.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling: Mapping[str, Any] | SamplingParams | None = None,
        queue: str | None = None,
        priority: int = 0,
        deadline: float | int | timedelta | datetime | None = None,
        metadata: Mapping[str, Any] | None = None,
        stream: bool = False,
        job_id: str | None = None,
        score: Mapping[str, Any] | None = None,
        tools: list[Mapping[str, Any]] | None = None,
    ) -> str:
        """``Client.submit``: rides a short Redis outage, and an id sent again after a lost reply
        is not enqueued twice."""
        job = make_job(
            prompt, messages=messages, prompt_token_ids=prompt_token_ids, sampling=sampling,
            priority=priority, deadline=deadline, metadata=metadata, stream=stream, job_id=job_id, score=score,
            tools=tools,
        )
        queue = queue_name(queue or self.queue)
        if self.check_revisions:
            await self.check_revision(job, queue)
        await self._ride(Outage(), self._enqueue, job, queue, self.redis)
        return job.id

    async def check_revision(self, job: Job, queue: str | None = None, *, reads: Iterable[str] = ()) -> None:
        """``Client.check_revision``."""
        need = job_needs(job, reads)
        if need is not None:
            await self._read_revisions(Outage())
            self._revisions.check(need, queue_name(queue or self.queue))

    async def _check_revisions(self, jobs: list[tuple[Job, str]], first: int | None, outage: Outage | None) -> None:
        """``RevisionNotSpoken`` for the first of ``jobs`` their queue's live workers cannot read,
        named by its position from ``first`` (None: one job); ``outage`` None reads without riding one."""
        needs = needing(jobs) if self.check_revisions else []
        if needs:  # NOTE: plain jobs cost nothing here
            await self._read_revisions(outage)
            self._revisions.check_all(needs, first)

    async def _read_revisions(self, outage: Outage | None) -> None:
        if self._revisions.stale():
            read = self.redis.hgetall(self.keys.workers) if outage is None else \
                self._ride(outage, self.redis.hgetall, self.keys.workers)
            self._revisions.read(await read)

    async def submit_job(self, job: Job, queue: str | None = None) -> str:
        """Enqueue a ``Job`` already built (and so checked) by ``make_job``; its id. Does not wait
        for an absent Redis: the gateway answers its request 503 at once. ``RevisionNotSpoken``
        (not enqueued) as ``submit`` raises it."""
        queue = queue_name(queue or self.queue)
        await self._check_revisions([(job, queue)], None, None)
        await self._enqueue(job, queue, self.redis)
        return job.id

    async def submit_jobs(self, jobs: list[Job], queue: str | None = None) -> list[str]:
        """``submit_job`` for several ``Job``s together (one request's prompts): one pipeline, no
        wait for an absent Redis. Their ids; a job refused halfway may leave the others enqueued,
        but one the live workers cannot read (``RevisionNotSpoken``, naming its position) is
        found before any is."""
        chunk = [(job, queue_name(queue or self.queue)) for job in jobs]
        await self._check_revisions(chunk, 0, None)
        return await self._enqueue_chunk(chunk)

    async def submit_many(self, jobs: Iterable[Mapping[str, Any] | Job], *, queue: str | None = None,
                          timeout: float | None = None) -> list[str]:
        """``Client.submit_many``: rides a short Redis outage, for at most ``timeout`` seconds when given."""
        ids: list[str] = []
        outage = Outage(deadline=wait_deadline(timeout))
        for chunk in job_chunks(jobs, queue_name(queue or self.queue)):
            await self._check_revisions(chunk, len(ids), outage)
            ids += await self._ride(outage, self._enqueue_chunk, chunk)
        return ids

    async def _enqueue_chunk(self, chunk: list[tuple[Job, str]]) -> list[str]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for job, queue in chunk:
                await self._enqueue(job, queue, pipe)
            await pipe.execute()
        return [job.id for job, _ in chunk]

    async def _enqueue(self, job: Job, queue: str, client: Any) -> Any:
        return await self._submit_script(**submit_call(self.keys, job, queue), client=client)

    async def status(self, job_id: str) -> JobStatus:
        return status_of(job_id, await self._ride(Outage(), self.redis.hgetall, self.keys.job(job_id)),
                         self.keys.prefix)

    async def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        deadline = wait_deadline(timeout)
        outage = Outage(deadline=deadline)
        while True:
            done = outcome(job_id, await self._ride(outage, self.redis.hgetall, self.keys.job(job_id)), self.keys.prefix)
            if done is not None:
                return done
            if remaining(deadline) == 0:
                raise Timeout(job_id, timeout)
            await self._ride(outage, self._wait_done, job_id, deadline)

    async def results(self, job_ids: list[str], timeout: float | None = None) -> list[JobResult]:
        """Each job's ``result``, in order (one request's prompts), waited on over one connection at
        a time rather than one each: the jobs in turn (one already ended costs an ``HGETALL``), the
        block on each cut every ``RESULTS_WATCH_S`` for a look at the others' statuses in one
        pipelined round trip, so the first found ended other than done raises as ``result`` raises,
        within that time of its end; the last job's end is read as soon as it comes. ``Timeout``
        names the job waited on then; rides a Redis outage as ``result`` does."""
        deadline = wait_deadline(timeout)
        outage = Outage(deadline=deadline)
        watch = ResultsWatch(job_ids, deadline)
        done: list[JobResult] = []
        for at, job_id in enumerate(job_ids):
            while (result := outcome(job_id, await self._ride(outage, self.redis.hgetall, self.keys.job(job_id)),
                                     self.keys.prefix)) is None:
                if remaining(deadline) == 0:
                    raise Timeout(job_id, timeout)
                await self._ride(outage, self._wait_done, job_id, watch.block_until())
                if others := watch.due(at):
                    watch.looked(others, await self._ride(outage, self._look, others))
            done.append(result)
        return done

    async def _look(self, job_ids: list[str]) -> list[str]:
        """Those of ``job_ids`` still queued or running, read in one pipelined round trip (on a
        cluster, one per node: the jobs' keys lie in different slots); raises as ``result`` does
        for the first that ended other than done."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(self.keys.job(job_id), JobField.STATUS)
            live, ended = unfinished(job_ids, await pipe.execute())
        if ended is not None:
            outcome(ended, await self.redis.hgetall(self.keys.job(ended)), self.keys.prefix)  # raises: an end is final
        return live

    async def _ride(self, outage: Outage, call: Callable[..., Awaitable[T]], *args: Any) -> T:
        while True:
            try:
                value = await call(*args)
            except OUTAGE_ERRORS as exc:
                await asyncio.sleep(outage.failed(exc))
                continue
            except ResponseError as exc:
                if not is_unblocked(exc):
                    raise
                await asyncio.sleep(outage.failed(exc))
                continue
            outage.ok()
            return value

    async def _wait_done(self, job_id: str, deadline: float | None) -> None:
        done_key = self.keys.done(job_id)
        chunk = block_chunk(remaining(deadline), self.socket_timeout)  # the time left now, after an outage too
        signal = await self.redis.blmove(done_key, done_key, chunk, "RIGHT", "LEFT")
        if signal is not None and await self.redis.hget(self.keys.job(job_id), JobField.STATUS) in LIVE_STATUSES:
            await asyncio.sleep(0.01)  # a worker that signals before it writes the hash: let it finish

    async def stream_deltas(self, job_id: str, timeout: float | None = None) -> AsyncIterator[TokenDelta]:
        async for batch in self.stream_delta_batches(job_id, timeout):
            for delta in batch:
                yield delta

    async def stream_delta_batches(self, job_id: str, timeout: float | None = None,
                                   idle_check_s: float = STREAM_IDLE_CHECK_S) -> AsyncIterator[list[TokenDelta]]:
        """``stream_deltas``, one non-empty list per read from Redis: the deltas that arrived
        together, so a reader that fell behind can answer them in one go. ``idle_check_s``:
        how long a silent stream waits before it looks at the job hash (every end of a
        streamed job writes a closing entry, so a reader of many queued jobs may wait longer)."""
        deadline = wait_deadline(timeout)
        outage = Outage(deadline=deadline)
        if await self._ride(outage, self.redis.hget, self.keys.job(job_id), JobField.STREAM) == "0":
            # no deltas will come: wait on the done signal, which wakes at the end itself
            yield list(whole_result(await self.result(job_id, remaining(deadline))))
            return
        tokens_key, last_id = self.keys.tokens(job_id), "0-0"
        reader = ExactDeltas()  # every token once, by offset (producers/deltas.py)
        tail = self.streams.follow(tokens_key) if self.streams is not None else None
        wait: float | None = None  # the first read waits for nothing: a job long done answers at once
        try:
            while True:
                entries = await self._next_entries(outage, tail, tokens_key, last_id, wait)
                batch = []
                for last_id, fields in entries:
                    delta = reader.take(TokenDelta.from_fields(fields))
                    if delta is not None:
                        batch.append(delta)
                if batch:
                    yield batch
                if reader.complete:
                    await self.result(job_id, remaining(deadline))
                    if rest := await self._drain(outage, tail, tokens_key, last_id, reader):
                        yield rest
                    return
                if not entries:
                    done = outcome(job_id, await self._ride(outage, self.redis.hgetall, self.keys.job(job_id)),
                                   self.keys.prefix)
                    if done is not None:
                        rest = (await self._drain(outage, tail, tokens_key, last_id, reader) if reader.seen
                                else list(whole_result(done)))
                        if rest:
                            yield rest
                        return
                left = remaining(deadline)
                if left == 0:
                    raise Timeout(job_id, timeout)
                wait = block_chunk(left, self.socket_timeout, cap=idle_check_s)
        finally:
            if tail is not None:
                self.streams.leave(tail)

    async def _next_entries(self, outage: Outage, tail: Tail | None, tokens_key: str, last_id: str,
                            wait: float | None) -> list[tuple[str, dict[str, str]]]:
        """The stream's next entries after ``last_id``, waiting up to ``wait`` seconds (None: not at all)."""
        if tail is not None:
            return await self.streams.take(tail, wait or 0.0)
        reply = await self._ride(outage, self.redis.xread, {tokens_key: last_id}, 256,
                                 None if wait is None else block_ms(wait))
        return [entry for _, entries in reply or () for entry in entries]

    async def _drain(self, outage: Outage, tail: Tail | None, tokens_key: str, last_id: str,
                     reader: ExactDeltas) -> list[TokenDelta]:
        """What the stream holds after ``last_id``, once the job has ended (the shared reader's
        share first, then the rest, read here)."""
        entries: list[tuple[str, dict[str, str]]] = []
        if tail is not None:
            self.streams.leave(tail)
            entries = tail.entries
            tail.entries = []
            if entries:
                last_id = entries[-1][0]
        for _, more in await self._ride(outage, self.redis.xread, {tokens_key: last_id}) or ():
            entries += more
        batch = []
        for _, fields in entries:
            delta = reader.take(TokenDelta.from_fields(fields))
            if delta is not None:
                batch.append(delta)
        return batch

    async def stream(self, job_id: str, timeout: float | None = None) -> AsyncIterator[str]:
        async for delta in self.stream_deltas(job_id, timeout):
            if delta.index == 0 and delta.text:
                yield delta.text

    async def cancel(self, job_id: str, ttl: int = DEFAULT_CANCEL_TTL_S,
                     result_ttl: int = DEFAULT_RESULT_TTL_S) -> bool:
        """``Client.cancel``: a queued job ends at once, a running one when its worker sees it;
        rides a short Redis outage, and a call sent again after a lost reply counts the job it
        finds cancelled as cancelled by it."""
        outage = Outage()
        queue = await self._ride(outage, self.redis.hget, self.keys.job(job_id), JobField.QUEUE)  # fixed at submission
        call = cancel_call(self.keys, job_id, queue, ttl, result_ttl)
        sent = 0

        async def send() -> Any:
            nonlocal sent
            sent += 1
            return await self._cancel_script(**call)

        return cancel_outcome(await self._ride(outage, send), resent=sent > 1)
