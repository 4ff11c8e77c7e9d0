"""Protocol v1: the contract between producers and workers (see PROTOCOL.md).

Every Redis key name and every payload schema lives here. Payloads are JSON only; nothing
read from Redis is ever unpickled or evaluated.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from producers.protocol.job import (  # noqa: F401  (the job schema is part of the protocol's surface)
    MAX_ID_LENGTH,
    PROTOCOL_VERSION,
    _ID_RE,
    ChatMessage,
    Job,
    ProtocolError,
    check_job_id,
    describe_validation_error,
    parse_job,
)
from producers.protocol.limits import LIMITS  # noqa: F401

DEFAULT_PREFIX = "sluiceway"
DEFAULT_QUEUES = ("interactive", "bulk")  # read in this order
CONSUMER_GROUP = "workers"
JOB_FIELD = "job"  # the one field of a stream entry
DEFAULT_CANCEL_TTL_S = 24 * 3600  # a cancel key outlives any job it could still reach


class Status(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({Status.DONE, Status.FAILED, Status.CANCELLED, Status.EXPIRED})


class Keys:
    """Every key name of protocol v1, under one prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if not prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"prefix must be a non-empty word, got {prefix!r}")
        self.prefix = prefix

    def queue(self, name: str) -> str:
        return f"{self.prefix}:queue:{name}"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def done(self, job_id: str) -> str:
        return f"{self.prefix}:done:{job_id}"

    def tokens(self, job_id: str) -> str:
        return f"{self.prefix}:tokens:{job_id}"

    def cancel(self, job_id: str) -> str:
        return f"{self.prefix}:cancel:{job_id}"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def workers(self) -> str:
        """Hash: worker name -> JSON heartbeat (host, pid, in flight, last seen)."""
        return f"{self.prefix}:workers"


def new_job_id() -> str:
    """An unguessable job id (128 random bits)."""
    return secrets.token_hex(16)


def check_queue_name(name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_ID_LENGTH or not _ID_RE.match(name):
        raise ValueError(
            f"queue name must be 1-{MAX_ID_LENGTH} letters, digits and . _ : @ -, got {name!r}"
        )
    return name


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class Timings(BaseModel):
    queue_s: float | None = None  # enqueued -> admitted into the engine
    ttft_s: float | None = None  # admitted -> first token
    total_s: float | None = None  # enqueued -> finished


class Completion(BaseModel):
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list[dict[str, float]] | None = None  # per token: {token_id: logprob}


class JobResult(BaseModel):
    """The ``result`` field of a finished job's hash."""

    id: str
    text: str  # the first completion's text
    outputs: list[Completion]
    usage: Usage
    metadata: dict[str, Any] = Field(default_factory=dict)
    timings: Timings = Field(default_factory=Timings)


class JobField:
    """Field names of a job's hash (``{prefix}:job:{id}``). Times are unix seconds."""

    STATUS = "status"  # a Status value
    RESULT = "result"  # JobResult JSON, when done
    ERROR = "error"  # text, when failed (also set for cancelled / expired: why)
    ATTEMPTS = "attempts"  # times a worker started the job
    WORKER = "worker"  # name of the worker that ran it last
    QUEUE = "queue"  # the queue name it was submitted on
    ENQUEUED_AT = "enqueued_at"
    STARTED_AT = "started_at"
    FINISHED_AT = "finished_at"
    ENTRY = "entry"  # "{queue}/{stream entry id}" of the delivery a worker runs (a second entry of it is skipped)
    STREAM = "stream"  # "1" / "0": the job's own stream flag, so a cancel can end a queued job itself
    QUEUED_ENTRY = "queued_entry"  # the stream entry id of the submission, which that cancel deletes


def _text(value: bytes | str | None) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


class JobStatus(BaseModel):
    """A job's hash as a client sees it (everything but the result)."""

    id: str
    status: Status
    attempts: int = 0
    worker: str | None = None
    queue: str | None = None
    enqueued_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    @classmethod
    def from_hash(cls, job_id: str, fields: Mapping[Any, Any]) -> "JobStatus":
        """Build from an HGETALL reply (bytes or str); unknown fields are ignored."""
        data = {_text(k): _text(v) for k, v in fields.items()}
        known = {name: data[name] for name in cls.model_fields if data.get(name) not in (None, "")}
        try:
            return cls.model_validate({**known, "id": job_id})
        except ValidationError as exc:
            raise ProtocolError(f"job hash of {job_id}: {describe_validation_error(exc)}", job_id) from None


class TokenDelta(BaseModel):
    """One entry of a streamed job's ``{prefix}:tokens:{id}`` stream.

    Stored as flat stream fields: ``index``, ``text``, ``token_ids`` (a JSON array) and,
    on the last entry of a completion, ``finish_reason``. A job that ends without finishing
    normally (cancelled, failed, expired) gets a last entry whose ``finish_reason`` is that
    status.
    """

    index: int = 0  # which completion, for n > 1
    text: str = ""  # text new since the completion's previous entry
    token_ids: list[int] = Field(default_factory=list)  # tokens new since the previous entry
    finish_reason: str | None = None

    def to_fields(self) -> dict[str, str]:
        fields = {"index": str(self.index), "text": self.text, "token_ids": json.dumps(self.token_ids)}
        if self.finish_reason is not None:
            fields["finish_reason"] = self.finish_reason
        return fields

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> "TokenDelta":
        data = {_text(k): _text(v) for k, v in fields.items()}
        try:
            return cls(
                index=int(data.get("index") or 0),
                text=data.get("text") or "",
                token_ids=json.loads(data.get("token_ids") or "[]"),
                finish_reason=data.get("finish_reason") or None,
            )
        except (ValueError, ValidationError) as exc:
            raise ProtocolError(f"bad tokens entry {data!r}: {exc}") from None


# NOTE: submission is one script so that "enqueue unless the id is already known" is atomic
# and still pipelines (a WATCH/MULTI per job would cost a round trip each). A job id that is
# queued, running or ended is never enqueued again; a fresh id clears any stale signal keys.
# KEYS: job hash, queue stream, done list, tokens stream, cancel key.
# ARGV: job JSON, enqueued_at, queue name, stream flag ('1' / '0'; optional: with it the hash
# also records the flag and the entry id, which a cancel of the queued job uses).
# Returns the stream entry id, or nil when skipped.
SUBMIT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5])
local entry = redis.call('XADD', KEYS[2], '*', 'job', ARGV[1])  -- first: a refused XADD leaves no hash behind
redis.call('HSET', KEYS[1], 'status', 'queued', 'attempts', '0', 'queue', ARGV[3], 'enqueued_at', ARGV[2])
if ARGV[4] then redis.call('HSET', KEYS[1], 'stream', ARGV[4], 'queued_entry', entry) end
return entry
"""

# NOTE: a queued job that no worker has started is ended here, at once, the way a worker ends
# one, and its queue entry is deleted: a web app's cancel must not wait for the backlog in
# front of the job. A worker that already read the entry finds the job ended and only
# acknowledges it. A running job (or a queued one submitted without the stream field) gets
# the cancel key, which its worker polls. Atomic against a worker's start script, so exactly
# one of the two ends the job.
# KEYS: job hash, done list, tokens stream, cancel key, the job's queue stream (its ``queue`` field).
# ARGV: cancel key TTL, now, result TTL (seconds the ended job's keys are kept).
# Returns the status the job had before the call ('queued' or 'running' when it had not
# ended, else its terminal status), or nil for a job with no hash (its key is set all the same:
# a Celery task or an entry written without the script gets its hash only when a worker reads it).
CANCEL_SCRIPT = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then  -- no hash yet (a Celery task, a hand-made entry): its worker checks the key
  redis.call('SET', KEYS[4], '1', 'EX', ARGV[1])
  return false
end
if status ~= 'queued' and status ~= 'running' then return status end
local stream = redis.call('HGET', KEYS[1], 'stream')
if status == 'running' or not stream then
  redis.call('SET', KEYS[4], '1', 'EX', ARGV[1])
  return status
end
local entry = redis.call('HGET', KEYS[1], 'queued_entry')
if entry then redis.pcall('XDEL', KEYS[5], entry) end  -- pcall: the producer role may not XDEL; a worker drops it
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[2], 'error', 'cancelled before it started')
redis.call('EXPIRE', KEYS[1], ARGV[3])
if stream == '1' then
  redis.call('XADD', KEYS[3], '*', 'index', '0', 'text', '', 'token_ids', '[]', 'finish_reason', 'cancelled')
  redis.call('EXPIRE', KEYS[3], ARGV[3])
end
redis.call('RPUSH', KEYS[2], 'cancelled')
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[4])
return status
"""
DEFAULT_RESULT_TTL_S = 24 * 3600  # the worker's --result-ttl default; a client's cancel of a queued job uses it too


def submit_keys(keys: Keys, job_id: str, queue: str) -> list[str]:
    """The KEYS of ``SUBMIT_SCRIPT`` for one job, in order."""
    return [keys.job(job_id), keys.queue(queue), keys.done(job_id), keys.tokens(job_id), keys.cancel(job_id)]


def cancel_keys(keys: Keys, job_id: str, queue: str) -> list[str]:
    """The KEYS of ``CANCEL_SCRIPT`` for one job of ``queue``, in order."""
    return [keys.job(job_id), keys.done(job_id), keys.tokens(job_id), keys.cancel(job_id), keys.queue(queue)]


class WorkerInfo(BaseModel):
    """One worker's heartbeat: the JSON value of its field in the ``{prefix}:workers`` hash.

    A worker rewrites its field every few seconds and deletes it on a clean exit. A field
    whose ``last_seen`` is older than ``stale_after_s`` belongs to a worker that died.
    """

    name: str
    host: str
    pid: int
    queues: list[str]
    model: str
    state: Literal["starting", "running", "draining"] = "running"
    started_at: float  # unix seconds
    last_seen: float  # unix seconds
    stale_after_s: float  # the heartbeat is missed for good after this long
    in_flight: int = 0  # jobs held (read and not yet acknowledged)
    capacity: int = 0  # jobs the engine could take right now
    admitted: int = 0  # jobs started since the worker started
    finished: int = 0  # jobs ended (any terminal status) since the worker started
    version: str = ""

    def alive(self, now: float) -> bool:
        return now - self.last_seen <= self.stale_after_s


class DeadLetterField:
    """Field names of a ``{prefix}:dead`` stream entry."""

    ENTRY = "entry"  # the raw entry's fields, as a JSON object of strings
    ERROR = "error"  # why it was dead-lettered
    QUEUE = "queue"  # the queue it was read from
    ENTRY_ID = "entry_id"  # its id in that queue
    JOB_ID = "job_id"  # empty when no id could be read
    WORKER = "worker"
    AT = "at"  # unix seconds


# NOTE: the element a worker pushes on ``{prefix}:done:{id}`` is the job's terminal status
# (``done``, ``failed``, ``cancelled`` or ``expired``), pushed once in the same script that
# stores the status, so a BLPOP wakes with the outcome already readable.
