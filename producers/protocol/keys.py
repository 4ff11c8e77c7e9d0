"""Protocol v1's names: every Redis key under one prefix, the queues, the consumer group, job
ids and the fields of a job's hash (PROTOCOL.md, "Keys")."""

from __future__ import annotations

import re
import secrets
from typing import Any

DEFAULT_PREFIX = "sluiceway"
DEFAULT_QUEUES = ("interactive", "bulk")  # read in this order
CONSUMER_GROUP = "workers"
JOB_FIELD = "job"  # the field of a stream entry that holds the job
# NOTE: the submit script also writes the job hash's key in the entry, so a worker can fail
# the job a client waits on even when the ``job`` value is garbage it cannot read an id from.
HASH_FIELD = "hash"
DEFAULT_CANCEL_TTL_S = 24 * 3600  # a cancel key outlives any job it could still reach
DEFAULT_RESULT_TTL_S = 24 * 3600  # the worker's --result-ttl default; a client's cancel of a queued job uses it too

MAX_ID_LENGTH = 128
_ID_RE = re.compile(r"^[A-Za-z0-9._:@-]+$")


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

    def outstanding(self, tenant: str) -> str:
        """Sorted set: the OpenAI gateway's requests of one tenant not yet answered (job id ->
        the unix time after which the entry no longer counts, should its gateway die)."""
        return f"{self.prefix}:gateway:outstanding:{tenant}"

    @property
    def workers(self) -> str:
        """Hash: worker name -> JSON heartbeat (host, pid, in flight, last seen)."""
        return f"{self.prefix}:workers"


class JobField:
    """Field names of a job's hash (``{prefix}:job:{id}``). Times are unix seconds."""

    STATUS = "status"  # a Status value
    RESULT = "result"  # JobResult JSON, when done
    ERROR = "error"  # text, when failed (also set for cancelled / expired: why)
    ERROR_CODE = "error_code"  # an ErrorCode value, when the job ended other than done
    ATTEMPTS = "attempts"  # times a worker started the job
    WORKER = "worker"  # name of the worker that ran it last
    QUEUE = "queue"  # the queue name it was submitted on
    ENQUEUED_AT = "enqueued_at"
    STARTED_AT = "started_at"
    FINISHED_AT = "finished_at"
    ENTRY = "entry"  # "{queue}/{stream entry id}" of the delivery a worker runs (a second entry of it is skipped)
    STREAM = "stream"  # "1" / "0": the job's own stream flag, so a cancel can end a queued job itself
    QUEUED_ENTRY = "queued_entry"  # the stream entry id of the submission, which that cancel deletes


def entry_ref(queue: str, entry_id: str) -> str:
    """How a job hash names the stream entry that holds it (its ``entry`` field)."""
    return f"{queue}/{entry_id}"


def new_job_id() -> str:
    """An unguessable job id (128 random bits)."""
    return secrets.token_hex(16)


def check_job_id(job_id: Any) -> str:
    """``job_id`` if it is a valid id, else ``ValueError`` naming what is wrong with it."""
    if not isinstance(job_id, str) or not job_id:
        raise ValueError(f"id must be a non-empty string, got {job_id!r}")
    if len(job_id) > MAX_ID_LENGTH:
        raise ValueError(f"id is {len(job_id)} characters long; the limit is {MAX_ID_LENGTH}")
    if not _ID_RE.match(job_id):
        raise ValueError(f"id {job_id!r} may hold only letters, digits and . _ : @ -")
    return job_id


def check_queue_name(name: Any) -> str:
    """``name`` if it is a valid queue name (the same characters as an id), else ``ValueError``."""
    if not isinstance(name, str) or not name or len(name) > MAX_ID_LENGTH or not _ID_RE.match(name):
        raise ValueError(
            f"queue name must be 1-{MAX_ID_LENGTH} letters, digits and . _ : @ -, got {name!r}"
        )
    return name
