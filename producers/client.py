"""The synchronous producer client: submit jobs, read their status, wait for or stream results.

    from producers.client import Client

    client = Client("redis://localhost:6379/0")
    job_id = client.submit("What is the capital of France?", sampling={"max_tokens": 32})
    print(client.result(job_id, timeout=60).text)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

import redis

from engine.sampling_params import SamplingParams
from producers.connection import UnsupportedServer, check_cluster_layout, connect, connection_kwargs_of
from producers.deltas import ExactDeltas
from producers.scripting import register
from producers.errors import Timeout
from producers.heartbeats import Fleet, read_fleet
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
    CONSUMER_GROUP,
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
    WorkerInfo,
    job_needs,
)
from producers.worker_revisions import WorkerRevisions, needing

T = TypeVar("T")


@dataclass
class QueueInfo:
    name: str
    backlog: int  # entries whose job has not ended (an entry is deleted when its job ends)
    held: int  # of those, entries a worker has read and holds


class Client:
    """Talks protocol v1 to a Redis server (``redis://``, ``rediss://``, ``unix://``, or the
    primary behind sentinels, ``redis+sentinel://``: ``producers.connection``; user and password
    in the URL as redis-py reads them). ``queue`` is where ``submit`` puts jobs; ``redis_kwargs``
    go to redis-py (e.g. ``ssl_ca_certs``)."""

    def __init__(
        self,
        url: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        queue: str = "interactive",
        queue_shards: int = 0,
        **redis_kwargs: Any,
    ) -> None:
        self.keys = Keys(prefix, queue_shards)
        self.queue = queue_name(queue)
        self.redis = connect(url, decode_responses=True, **redis_kwargs)
        try:
            check_cluster_layout(self.redis, queue_shards)  # now, not as CROSSSLOT at the first submit
        except UnsupportedServer:
            self.redis.close()
            raise
        self._submit_script = register(self.redis, SUBMIT_SCRIPT)
        self._cancel_script = register(self.redis, CANCEL_SCRIPT)
        self._revisions = WorkerRevisions()
        self.socket_timeout = socket_timeout_of(connection_kwargs_of(self.redis))

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- submitting -------------------------------------------------------------------------

    def submit(
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
        """Enqueue one job and return its id.

        Exactly one of ``prompt``, ``messages``, ``prompt_token_ids``. ``deadline`` is a unix
        time, a ``datetime``, a ``timedelta`` or seconds from now. An id that is already
        queued, running or ended is not enqueued again (its id is returned all the same), which
        is what lets it ride a short Redis outage (a restart, a failover) as ``result`` does: a
        submission retried after a lost reply enqueues nothing twice.
        ``score={"continuations": [...]}`` makes it a scoring job (no ``sampling``): its result
        has ``scores``, the log-likelihood of each continuation of the prompt (PROTOCOL.md).
        ``tools`` (with ``messages``): OpenAI-style function declarations the model's chat
        template shows it (PROTOCOL.md, "Tool calling"). A job with a field of a later protocol
        revision than a live worker of the queue speaks (``tools`` where one speaks 1.2) raises
        ``RevisionNotSpoken`` (an ``InvalidJob``) and is not enqueued: any of them may take it, and
        that one would refuse it.
        """
        job = make_job(
            prompt, messages=messages, prompt_token_ids=prompt_token_ids, sampling=sampling,
            priority=priority, deadline=deadline, metadata=metadata, stream=stream, job_id=job_id, score=score,
            tools=tools,
        )
        queue = queue_name(queue or self.queue)
        self.check_revision(job, queue)
        self._ride(Outage(), self._enqueue, job, queue, self.redis)
        return job.id

    def check_revision(self, job: Job, queue: str | None = None, *, reads: Iterable[str] = ()) -> None:
        """``RevisionNotSpoken`` when ``job`` gives a field of a later protocol revision than a live
        worker of ``queue`` speaks (or its reader needs a result field of one, ``reads``:
        ``producers.protocol.revisions.job_needs``). The heartbeats are read at most every 2 s,
        and only for such a job (``producers.worker_revisions``); ``submit`` and ``submit_many``
        check each job so. A caller that ends a refused job its own way (``sluiceway bulk``: the
        row's error) checks first."""
        need = job_needs(job, reads)
        if need is not None:
            self._read_revisions(Outage())
            self._revisions.check(need, queue_name(queue or self.queue))

    def _check_revisions(self, jobs: list[tuple[Job, str]], first: int, outage: Outage) -> None:
        """``RevisionNotSpoken`` for the first of ``jobs`` their queue's live workers cannot read,
        named by its position from ``first``."""
        needs = needing(jobs)
        if needs:  # NOTE: plain jobs cost nothing here
            self._read_revisions(outage)
            self._revisions.check_all(needs, first)

    def _read_revisions(self, outage: Outage) -> None:
        if self._revisions.stale():
            self._revisions.read(self._ride(outage, self.redis.hgetall, self.keys.workers))

    def submit_many(self, jobs: Iterable[Mapping[str, Any] | Job], *, queue: str | None = None,
                    timeout: float | None = None) -> list[str]:
        """Enqueue many jobs, pipelined; each item is a ``Job`` or a dict of ``submit``'s
        keyword arguments. ``InvalidJob`` names the first bad item by position, and so does
        ``RevisionNotSpoken`` (one the queue's live workers cannot read, as ``submit`` refuses
        it); the chunks before it (``SUBMIT_CHUNK`` jobs each) are already enqueued. Rides a
        short Redis outage as ``submit`` does (a chunk sent again enqueues only what had not
        arrived), for at most ``timeout`` seconds when given: the connection error is raised then."""
        ids: list[str] = []
        outage = Outage(deadline=wait_deadline(timeout))
        for chunk in job_chunks(jobs, queue_name(queue or self.queue)):
            self._check_revisions(chunk, len(ids), outage)
            ids += self._ride(outage, self._enqueue_chunk, chunk)
        return ids

    def _enqueue_chunk(self, chunk: list[tuple[Job, str]]) -> list[str]:
        with self.redis.pipeline(transaction=False) as pipe:
            for job, queue in chunk:
                self._enqueue(job, queue, pipe)
            pipe.execute()
        return [job.id for job, _ in chunk]

    def _enqueue(self, job: Job, queue: str, client: Any) -> Any:
        return self._submit_script(**submit_call(self.keys, job, queue), client=client)

    # -- reading ----------------------------------------------------------------------------

    def status(self, job_id: str) -> JobStatus:
        """The job's status, attempts, worker, times and error; ``JobNotFound`` if unknown.
        Rides a short Redis outage (a restart, a failover) as ``result`` does."""
        return status_of(job_id, self._ride(Outage(), self.redis.hgetall, self.keys.job(job_id)), self.keys.prefix)

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Wait for the job to end and return its result.

        Blocks on the job's done signal without consuming it, so any number of waiters and
        repeated calls all return. Raises ``JobFailed``, ``JobCancelled``, ``JobExpired``,
        ``JobNotFound``, or ``Timeout`` after ``timeout`` seconds (``None``: no limit).
        """
        deadline = wait_deadline(timeout)
        outage = Outage(deadline=deadline)
        while True:
            done = outcome(job_id, self._ride(outage, self.redis.hgetall, self.keys.job(job_id)), self.keys.prefix)
            if done is not None:
                return done
            if remaining(deadline) == 0:
                raise Timeout(job_id, timeout)
            self._ride(outage, self._wait_done, job_id, deadline)

    def results(self, job_ids: list[str], timeout: float | None = None) -> list[JobResult]:
        """Each job's ``result``, in order, waited on over one connection rather than a thread each.

        The jobs are waited on in turn (one already ended costs an ``HGETALL``); the wait on each
        is cut every ``RESULTS_WATCH_S`` (0.5 s) for a look at the statuses of the jobs after it,
        in one pipelined round trip, so the first found ended other than done raises as ``result``
        raises within that time of its end, while an earlier job still runs. ``Timeout`` names the
        job waited on when ``timeout`` seconds (for them all) have passed; rides a Redis outage as
        ``result`` does.
        """
        deadline = wait_deadline(timeout)
        outage = Outage(deadline=deadline)
        watch = ResultsWatch(job_ids, deadline)
        done: list[JobResult] = []
        for at, job_id in enumerate(job_ids):
            while (result := outcome(job_id, self._ride(outage, self.redis.hgetall, self.keys.job(job_id)),
                                     self.keys.prefix)) is None:
                if remaining(deadline) == 0:
                    raise Timeout(job_id, timeout)
                self._ride(outage, self._wait_done, job_id, watch.block_until())
                if others := watch.due(at):
                    watch.looked(others, self._ride(outage, self._look, others))
            done.append(result)
        return done

    def _look(self, job_ids: list[str]) -> list[str]:
        """Those of ``job_ids`` still queued or running, read in one pipelined round trip (on a
        cluster, one per node); raises as ``result`` does for the first that ended other than done."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(self.keys.job(job_id), JobField.STATUS)
            live, ended = unfinished(job_ids, pipe.execute())
        if ended is not None:
            outcome(ended, self.redis.hgetall(self.keys.job(ended)), self.keys.prefix)  # raises: an end is final
        return live

    def _ride(self, outage: Outage, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)``, retried through a short Redis outage (a restart, a dropped connection)."""
        while True:
            try:
                value = call(*args)
            except OUTAGE_ERRORS as exc:
                time.sleep(outage.failed(exc))
                continue
            except redis.ResponseError as exc:
                if not is_unblocked(exc):
                    raise
                time.sleep(outage.failed(exc))
                continue
            outage.ok()
            return value

    def _wait_done(self, job_id: str, deadline: float | None) -> None:
        done_key = self.keys.done(job_id)
        # NOTE: moving the list's element onto the same list is an atomic rotation: the waiter
        # wakes and the signal stays for every other waiter (and is handed on to them).
        chunk = block_chunk(remaining(deadline), self.socket_timeout)  # the time left now, after an outage too
        signal = self.redis.blmove(done_key, done_key, chunk, "RIGHT", "LEFT")
        if signal is not None and self.redis.hget(self.keys.job(job_id), JobField.STATUS) in LIVE_STATUSES:
            time.sleep(0.01)  # a worker that signals before it writes the hash: let it finish

    def stream_deltas(self, job_id: str, timeout: float | None = None) -> Iterator[TokenDelta]:
        """Every token entry of the job (all completions) as it arrives, until the job ends.

        Read by offset (``producers.deltas.ExactDeltas``): each token comes once, in order,
        even when the job's worker died and another resumed it, or a write was repeated.
        A job submitted without ``stream`` yields its finished completions once, at the end.
        Raises like ``result`` when the job ends without a result.
        """
        deadline = wait_deadline(timeout)
        outage = Outage(deadline=deadline)
        if self._ride(outage, self.redis.hget, self.keys.job(job_id), JobField.STREAM) == "0":
            # no deltas will come: wait on the done signal, which wakes at the end itself
            yield from whole_result(self.result(job_id, remaining(deadline)))
            return
        tokens_key, last_id = self.keys.tokens(job_id), "0-0"
        reader = ExactDeltas()  # every token once, by offset (producers/deltas.py)
        block = None  # the first read does not block: a job that already ended is seen at once
        while True:
            reply = self._ride(outage, self.redis.xread, {tokens_key: last_id}, 256, block)
            for _, entries in reply or ():
                for last_id, fields in entries:
                    delta = reader.take(TokenDelta.from_fields(fields))
                    if delta is not None:
                        yield delta
            if reader.complete:
                self.result(job_id, remaining(deadline))  # ends now; raises unless done
                yield from self._drain(outage, tokens_key, last_id, reader)
                return
            if not reply:
                done = outcome(job_id, self._ride(outage, self.redis.hgetall, self.keys.job(job_id)), self.keys.prefix)
                if done is not None:
                    yield from self._drain(outage, tokens_key, last_id, reader) if reader.seen else whole_result(done)
                    return
            left = remaining(deadline)
            if left == 0:
                raise Timeout(job_id, timeout)
            block = block_ms(block_chunk(left, self.socket_timeout, cap=STREAM_IDLE_CHECK_S))

    def _drain(self, outage: Outage, tokens_key: str, last_id: str, reader: ExactDeltas) -> Iterator[TokenDelta]:
        for _, entries in self._ride(outage, self.redis.xread, {tokens_key: last_id}) or ():
            for _, fields in entries:
                delta = reader.take(TokenDelta.from_fields(fields))
                if delta is not None:
                    yield delta

    def stream(self, job_id: str, timeout: float | None = None) -> Iterator[str]:
        """The first completion's text, delta by delta, as the worker writes it."""
        for delta in self.stream_deltas(job_id, timeout):
            if delta.index == 0 and delta.text:
                yield delta.text

    def queues(self) -> dict[str, QueueInfo]:
        """Every queue stream under the prefix: entries not yet ended, and those held by workers."""
        found: dict[str, QueueInfo] = {}
        # NOTE: in the cluster layout a queue is the sum of its shard streams (scanned on every master)
        pattern = f"{self.keys.prefix}:{{s*}}:queue:*" if self.keys.shards else self.keys.queue("*")
        for key in sorted(self.redis.scan_iter(match=pattern, _type="stream")):
            name = key.partition(":queue:")[2] if self.keys.shards else key.removeprefix(self.keys.queue(""))
            try:
                held = self.redis.xpending(key, CONSUMER_GROUP)["pending"]
            except redis.ResponseError:  # no worker has created the group yet
                held = 0
            info = found.setdefault(name, QueueInfo(name=name, backlog=0, held=0))
            info.backlog += self.redis.xlen(key)
            info.held += held
        return found

    def fleet(self) -> Fleet:
        """The workers' heartbeats as read now (``producers.heartbeats``): each one's record, whether
        it runs (``fresh``) and takes jobs (``live``), and the records that are no heartbeat."""
        return read_fleet(self.redis.hgetall(self.keys.workers))

    def workers(self) -> list[WorkerInfo]:
        """The workers' heartbeat records, by name (dead ones included: ``fleet`` says which run);
        a record that is not a heartbeat is skipped."""
        return [worker.info for worker in self.fleet().workers]

    # -- cancelling -------------------------------------------------------------------------

    def cancel(self, job_id: str, ttl: int = DEFAULT_CANCEL_TTL_S, result_ttl: int = DEFAULT_RESULT_TTL_S) -> bool:
        """Cancel the job; True if it had not ended.

        A job no worker has started ends ``cancelled`` at once (its keys kept ``result_ttl``
        seconds, as a worker keeps them); a running one once its worker sees the request,
        within a fraction of a second. ``result`` then raises ``JobCancelled``.

        Rides a short Redis outage as ``submit`` does. A call sent again after a lost reply
        finds the job already cancelled: that counts as cancelled by this call (True).
        """
        outage = Outage()
        queue = self._ride(outage, self.redis.hget, self.keys.job(job_id), JobField.QUEUE)  # fixed at submission
        call = cancel_call(self.keys, job_id, queue, ttl, result_ttl)
        sent = 0

        def send() -> Any:
            nonlocal sent
            sent += 1
            return self._cancel_script(**call)

        return cancel_outcome(self._ride(outage, send), resent=sent > 1)
