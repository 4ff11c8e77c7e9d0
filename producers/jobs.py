"""The I/O-free half of the clients: building jobs and reading how they ended.

``Client`` and ``AsyncClient`` do only the Redis calls and share everything here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import Any

import redis
from pydantic import ValidationError

from engine.sampling_params import SamplingParams
from producers.connection import DEFAULT_URL, URL_ENV, resolve_url  # noqa: F401  (re-exported)
from producers.errors import InvalidJob, JobNotFound, job_error
from producers.protocol import (
    LIVE_STATUSES,
    Job,
    JobField,
    JobResult,
    JobStatus,
    Keys,
    ProtocolError,
    Status,
    TokenDelta,
    cancel_keys,
    check_queue_name,
    describe_validation_error,
    new_job_id,
    submit_keys,
)
from producers.protocol.limits import MAX_ENTRY_BYTES, MAX_METADATA_BYTES, MAX_STOP_TOKEN_IDS, utf8_len

SUBMIT_CHUNK = 1000  # jobs per pipeline round trip in submit_many
# NOTE: waits are cut into chunks so a wait notices a lost signal (e.g. a Redis restart
# without persistence) and never outlives the connection's own socket timeout.
MAX_BLOCK_S = 60.0
MIN_BLOCK_S = 0.01  # the shortest block a wait asks Redis for
# NOTE: how long a stream waits on silent token entries before it looks at the job hash
# (a job submitted without "stream", or one that ended before it ran, writes none).
STREAM_IDLE_CHECK_S = 1.0
# NOTE: ``results`` (either client) blocks on one job's done signal at a time and, at most this often,
# reads the statuses of the others (one pipelined HGET each; Redis has no wait that leaves the
# signal in place on several lists at once), so one that fails is seen within this time. A look at
# 255 jobs took 4.4 ms of the client's CPU (redis-py 8.2, one core): 16 such requests, 14% of a core.
RESULTS_WATCH_S = 0.5
# NOTE: a wait rides out a Redis restart or a dropped connection for this long, retrying with
# backoff; an outage that lasts longer raises the connection error to the caller.
OUTAGE_WINDOW_S = 30.0
OUTAGE_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


def is_unblocked(exc: Exception) -> bool:
    """A blocking read the server let go with ``-UNBLOCKED``: a primary demoted by a planned
    failover (``SENTINEL FAILOVER``) does so to its blocked clients, as does ``CLIENT UNBLOCK
    id ERROR``. Nothing failed: the read is made again (on a demoted primary, a write then
    fails ``READONLY``, which the Sentinel client turns into a reconnect to the new one)."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("UNBLOCKED")


# NOTE: a bare number is read as seconds from now when it is below this (year 2001 as a unix
# time), and as a unix time above it; no real deadline is 30 years away.
ABSOLUTE_DEADLINE_AFTER = 1e9

# Keyword arguments of ``submit`` that an item of ``submit_many`` may carry.
SUBMIT_FIELDS = frozenset(
    {"prompt", "messages", "prompt_token_ids", "sampling", "queue", "priority", "deadline",
     "metadata", "stream", "job_id", "id", "score", "tools"}
)


def queue_name(name: Any) -> str:
    try:
        return check_queue_name(name)
    except ValueError as exc:
        raise InvalidJob(str(exc)) from None


def to_deadline(deadline: float | int | timedelta | datetime | None, now: float | None = None) -> float | None:
    """A unix time from a unix time, a ``datetime``, a ``timedelta`` or seconds from now."""
    if deadline is None:
        return None
    now = time.time() if now is None else now
    if isinstance(deadline, datetime):
        return deadline.timestamp()
    if isinstance(deadline, timedelta):
        return now + deadline.total_seconds()
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        raise InvalidJob(f"deadline must be a unix time, seconds from now, a timedelta or a datetime, got {deadline!r}")
    if not math.isfinite(deadline):
        raise InvalidJob(f"deadline: {deadline!r} is not a finite number (NaN and infinities are not allowed)")
    return float(deadline) if deadline > ABSOLUTE_DEADLINE_AFTER else now + float(deadline)


def make_job(
    prompt: str | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    prompt_token_ids: list[int] | None = None,
    sampling: Mapping[str, Any] | SamplingParams | None = None,
    priority: int = 0,
    deadline: float | int | timedelta | datetime | None = None,
    metadata: Mapping[str, Any] | None = None,
    stream: bool = False,
    job_id: str | None = None,
    score: Mapping[str, Any] | None = None,
    tools: list[Mapping[str, Any]] | None = None,
) -> Job:
    """Validate one job; ``InvalidJob`` names every bad field.

    The protocol's limits (``producers.protocol.limits``: prompt and metadata sizes, ``n``, stop
    lists, nesting, finite numbers, valid Unicode) are checked here too, so a job that a
    worker would refuse is refused before it is enqueued.
    """
    if isinstance(sampling, SamplingParams):
        sampling = sampling.to_dict()
    data = {
        "id": new_job_id() if job_id is None else job_id,
        "prompt": prompt,
        "messages": messages,
        "prompt_token_ids": prompt_token_ids,
        "sampling": _as_dict(sampling),
        "priority": priority,
        "deadline": to_deadline(deadline),
        "stream": stream,
        "metadata": _as_dict(metadata),
    }
    if score is not None:
        data["score"] = _as_dict(score)
    if tools is not None:
        data["tools"] = [_as_dict(t) for t in tools] if isinstance(tools, (list, tuple)) else tools
    try:
        job = Job.model_validate(data)
    except ValidationError as exc:
        raise InvalidJob(describe_validation_error(exc)) from None
    check_entry_size(job)
    return job


def _as_dict(value: Any) -> Any:
    """A mapping (or None) as the dict the job holds; anything else as it is, for ``Job`` to name
    (``sampling: expected an object, got an array``)."""
    if value is None:
        return {}
    return dict(value) if isinstance(value, Mapping) else value


def check_entry_size(job: Job) -> None:
    """``MAX_ENTRY_BYTES``, on the JSON this client writes; measured only for a job that could
    come near it (JSON escapes a character in at most 6 bytes, an integer in at most 65)."""
    text = utf8_len(job.prompt or "") + sum(utf8_len(m.content or "") for m in job.messages or [])
    bound = 6 * (text + MAX_METADATA_BYTES) + 65 * (len(job.prompt_token_ids or ()) + MAX_STOP_TOKEN_IDS) + 65_536
    # NOTE: tools and tool calls (JSON of any shape) are left out of the bound: such a job is measured
    tooled = job.tools is not None or any(m.tool_calls for m in job.messages or [])
    if bound <= MAX_ENTRY_BYTES and not tooled:
        return
    size = utf8_len(job.to_json())
    if size > MAX_ENTRY_BYTES:
        raise InvalidJob(f"job is {size:,} bytes of JSON; the limit is {MAX_ENTRY_BYTES:,} (MAX_ENTRY_BYTES)")


def make_job_from_item(item: Mapping[str, Any] | Job, default_queue: str) -> tuple[Job, str]:
    """One item of ``submit_many``: a ``Job`` or a dict of ``submit``'s keyword arguments."""
    if isinstance(item, Job):
        return item, default_queue
    if not isinstance(item, Mapping):  # NOTE: a string would be read as its characters, None not at all
        raise InvalidJob(f"expected a Job or a dict of submit()'s arguments, got {type(item).__name__} {item!r:.60}")
    unknown = sorted(set(item) - SUBMIT_FIELDS)
    if unknown:
        raise InvalidJob(f"unknown job field(s): {', '.join(unknown)}")
    kwargs = dict(item)
    queue = queue_name(kwargs.pop("queue", None) or default_queue)
    if "id" in kwargs:
        kwargs["job_id"] = kwargs.pop("id")
    return make_job(**kwargs), queue


def job_chunks(items: Iterable[Mapping[str, Any] | Job], default_queue: str) -> Iterator[list[tuple[Job, str]]]:
    """``submit_many``'s items validated, in chunks of ``SUBMIT_CHUNK``; a bad one is named by position."""
    if isinstance(items, (str, bytes, Mapping, Job)):  # one job where a list of them belongs
        raise InvalidJob(f"jobs: expected an iterable of jobs, got one {type(items).__name__}")
    chunk: list[tuple[Job, str]] = []
    for index, item in enumerate(items):
        try:
            chunk.append(make_job_from_item(item, default_queue))
        except InvalidJob as exc:
            raise InvalidJob(f"job {index}: {exc}") from None
        if len(chunk) == SUBMIT_CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def submit_call(keys: Keys, job: Job, queue: str) -> dict[str, list]:
    """The ``keys`` and ``args`` of one ``SUBMIT_SCRIPT`` call."""
    return {"keys": submit_keys(keys, job.id, queue),
            "args": [job.to_json(), repr(time.time()), queue, "1" if job.stream else "0"]}


def cancel_call(keys: Keys, job_id: str, queue: str | None, ttl: int, result_ttl: int) -> dict[str, list]:
    """The ``keys`` and ``args`` of one ``CANCEL_SCRIPT`` call; ``queue``: the job's ``queue``
    field (``None`` when it has no hash: the script then only sets the cancel key)."""
    return {"keys": cancel_keys(keys, job_id, queue or "interactive"),
            "args": [seconds_arg("ttl", ttl), repr(time.time()), seconds_arg("result_ttl", result_ttl)]}


def seconds_arg(name: str, value: Any) -> int:
    """A key's time to live, whole seconds >= 1: Redis refuses ``EX 0`` and expires a key at once
    on ``EXPIRE 0`` (a job cancelled so would vanish, its result unknown rather than cancelled)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1 or math.isinf(value):
        raise ValueError(f"{name}: expected whole seconds >= 1, got {value!r}")
    return int(value)


def wait_deadline(timeout: float | None) -> float | None:
    """The ``time.monotonic()`` at which a wait of ``timeout`` seconds ends (None: no limit); 0
    or less looks once without waiting. Not a number is refused here, naming it."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout: expected seconds (a number) or None, got {type(timeout).__name__} {timeout!r:.60}")
    if math.isnan(timeout):
        raise ValueError("timeout: expected seconds (a number) or None, got NaN")
    return time.monotonic() + timeout


def cancel_outcome(reply: str | bytes | None, resent: bool = False) -> bool:
    """``CANCEL_SCRIPT``'s reply (the status before the call) -> whether the job had not ended.
    ``resent``: the call was sent again after a lost reply, so a job it finds cancelled was
    cancelled by the first send (True)."""
    before = reply.decode() if isinstance(reply, bytes) else reply
    return before in LIVE_STATUSES or (resent and before == Status.CANCELLED.value)


def outcome(job_id: str, fields: Mapping[Any, Any], prefix: str) -> JobResult | None:
    """The result of an ended job, ``None`` while it runs; raises how it ended otherwise."""
    if not fields:
        raise JobNotFound(job_id, prefix)
    status = JobStatus.from_hash(job_id, fields)
    if not status.terminal:
        return None
    if status.status is not Status.DONE:
        raise job_error(job_id, status.status.value, status.error, status.error_code)
    raw = fields.get(JobField.RESULT, fields.get(JobField.RESULT.encode()))
    if raw is None:
        raise ProtocolError(f"job {job_id} is done but its hash holds no result", job_id)
    return JobResult.model_validate_json(raw)


def unfinished(job_ids: list[str], statuses: list[Any]) -> tuple[list[str], str | None]:
    """From the ``status`` of each of ``job_ids`` (None: no hash): those still queued or running,
    and the first that ended other than done or has no hash (None if none did), which ``outcome``
    of its whole hash raises for."""
    live = []
    for job_id, status in zip(job_ids, statuses):
        if status in LIVE_STATUSES:
            live.append(job_id)
        elif status != Status.DONE.value:
            return live, job_id
    return live, None


class ResultsWatch:
    """The bookkeeping of ``results``, which both clients share (they make the Redis calls): how
    long a wait on one job's done signal may block before the next look at the jobs after it, and
    which of those to look at (not the ones a look found done: they are read in their turn)."""

    def __init__(self, job_ids: list[str], deadline: float | None) -> None:
        self.job_ids = job_ids
        self.deadline = deadline  # a ``time.monotonic()``; None: no limit
        self._seen_done: set[str] = set()
        self._next_look = time.monotonic() + RESULTS_WATCH_S

    def block_until(self) -> float:
        """The ``time.monotonic()`` a wait on a done signal blocks until: the next look, or the deadline before it."""
        return self._next_look if self.deadline is None else min(self.deadline, self._next_look)

    def due(self, at: int) -> list[str]:
        """The jobs after ``job_ids[at]`` to look at now (not one before ``RESULTS_WATCH_S`` has passed
        since the last look); pass them to ``looked`` with what the look found."""
        if time.monotonic() < self._next_look:
            return []
        others = [other for other in self.job_ids[at + 1:] if other not in self._seen_done]
        if not others:  # nothing to look at: the next wait blocks as long again
            self._next_look = time.monotonic() + RESULTS_WATCH_S
        return others

    def looked(self, others: list[str], live: list[str]) -> None:
        """A look at ``others`` found ``live`` still queued or running, the rest done; the next look
        is ``RESULTS_WATCH_S`` from now."""
        self._seen_done.update(set(others) - set(live))
        self._next_look = time.monotonic() + RESULTS_WATCH_S


def status_of(job_id: str, fields: Mapping[Any, Any], prefix: str) -> JobStatus:
    if not fields:
        raise JobNotFound(job_id, prefix)
    return JobStatus.from_hash(job_id, fields)


def remaining(deadline: float | None) -> float | None:
    """Seconds left until a ``time.monotonic()`` deadline (``None``: no limit; never negative)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def block_chunk(left: float | None, socket_timeout: float | None, cap: float = MAX_BLOCK_S) -> float:
    """Seconds one blocking call may wait: under ``cap``, the time left and the socket timeout."""
    chunk = cap if left is None else min(cap, left)
    if socket_timeout:
        chunk = min(chunk, max(0.05, socket_timeout - 0.5))
    # NOTE: Redis reads a block timeout that rounds to 0 ms (0.001 s on 6.2) as "forever".
    return max(chunk, MIN_BLOCK_S)


# redis-py applies this read timeout when none is given (its connection default).
REDIS_DEFAULT_SOCKET_TIMEOUT_S = 5.0


def socket_timeout_of(connection_kwargs: dict[str, Any]) -> float | None:
    """The read timeout connections of a pool will use; None means none at all."""
    if "socket_timeout" in connection_kwargs:
        return connection_kwargs["socket_timeout"]
    return REDIS_DEFAULT_SOCKET_TIMEOUT_S


def block_ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))  # NOTE: BLOCK 0 would mean "forever"


def whole_result(result: JobResult) -> Iterator[TokenDelta]:
    """A finished job's completions as one delta each (for a job that streamed nothing)."""
    for index, completion in enumerate(result.outputs):
        yield TokenDelta(
            index=index, text=completion.text, token_ids=completion.token_ids, finish_reason=completion.finish_reason
        )


class Outage:
    """Backoff for a wait that lost Redis: ``failed`` gives the seconds to pause, or raises
    the error once Redis has been away longer than ``window``, or once the caller's own
    ``deadline`` (a ``time.monotonic()``; None: none) has passed; ``ok`` resets.

    Rides nest as one: an ``Outage`` made inside ``with outage:`` (a client call in a loop that
    rides outages itself, as ``sluiceway bulk``'s) counts Redis's absence from when either of
    them first met it, and stops at the enclosing deadline if that comes first, so an outage
    is ridden for one window however the calls nest."""

    def __init__(self, window: float = OUTAGE_WINDOW_S, deadline: float | None = None) -> None:
        enclosing = _RIDING.get()
        self.window = window
        self.deadline = deadline
        self._clock = self if enclosing is None else enclosing._clock  # the ride whose _since counts
        if enclosing is not None and enclosing.deadline is not None:
            self.deadline = enclosing.deadline if deadline is None else min(deadline, enclosing.deadline)
        self._since: float | None = None
        self._delay = 0.05
        self._token: Any = None

    def __enter__(self) -> "Outage":
        self._token = _RIDING.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _RIDING.reset(self._token)

    def failed(self, exc: Exception) -> float:
        now = time.monotonic()
        if self._clock._since is None:
            self._clock._since = now
        # NOTE: a wait given a timeout ends by it, outage or not: the connection error is raised
        # then (the job's state is unknown, so it is not reported as a Timeout)
        if now - self._clock._since > self.window or (self.deadline is not None and now >= self.deadline):
            raise exc
        delay, self._delay = self._delay, min(1.0, self._delay * 2)
        return delay if self.deadline is None else min(delay, self.deadline - now)

    def ok(self) -> None:
        self._clock._since = None
        self._delay = 0.05


# The ride a new ``Outage`` joins: the innermost ``with outage:`` of this thread or task.
_RIDING: ContextVar[Outage | None] = ContextVar("sluiceway_outage", default=None)
