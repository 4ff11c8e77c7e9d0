"""Protocol v1's names: every Redis key under one prefix, the queues, the consumer group, job
ids and the fields of a job's hash (PROTOCOL.md, "Keys")."""

from __future__ import annotations

import re
import secrets
import zlib
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
MAX_QUEUE_SHARDS = 1024
# What ``--queue-shards`` means, said the same by every command that takes it (worker, serve, the producer commands).
QUEUE_SHARDS_HELP = ("the cluster layout: each queue sharded over N hash-tagged streams, every worker, producer"
                     " and gateway the same N (default 0: the single-node layout; a Redis Cluster needs N >= 1)")
# NOTE: matched with fullmatch: a "$" also matches before a final newline, which let "abc\n" through
_ID_RE = re.compile(r"[A-Za-z0-9._:@-]+")


class Keys:
    """Every key name of protocol v1, under one prefix.

    ``shards`` 0 (the default) is the single-node layout: ``{prefix}:job:{id}``, one stream per
    queue. ``shards`` N >= 1 is the cluster layout (PROTOCOL.md, "The cluster layout"): a job
    belongs to shard ``crc32(id) mod N``; its keys and the queue stream it is submitted on carry
    that shard's hash tag, ``{prefix}:{sK}:...``, so every script's keys share one slot.
    """

    def __init__(self, prefix: str = DEFAULT_PREFIX, shards: int = 0) -> None:
        if not prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"prefix must be a non-empty word, got {prefix!r}")
        if isinstance(shards, bool) or not isinstance(shards, int) or not 0 <= shards <= MAX_QUEUE_SHARDS:
            raise ValueError(f"queue_shards must be an integer from 0 to {MAX_QUEUE_SHARDS}, got {shards!r}")
        if shards and ("{" in prefix or "}" in prefix):
            # NOTE: a brace in the prefix would become the hash tag and put every shard in one slot
            raise ValueError(f"prefix must not hold '{{' or '}}' with queue_shards {shards}, got {prefix[:100]!r}")
        self.prefix = prefix
        self.shards = shards

    # --- the shard of a job ---------------------------------------------------------------------
    def shard_of(self, job_id: str) -> int | None:
        """The shard a job's keys live in (None in the single-node layout)."""
        if not self.shards:
            return None
        return zlib.crc32(job_id.encode()) % self.shards

    def _base(self, shard: int | None) -> str:
        return self.prefix if shard is None else f"{self.prefix}:{{s{shard}}}"

    def _of_job(self, job_id: str) -> str:
        return self._base(self.shard_of(job_id))

    def shard_range(self) -> list[int | None]:
        """Every shard, in order: ``[None]`` in the single-node layout."""
        return list(range(self.shards)) if self.shards else [None]

    # --- keys -----------------------------------------------------------------------------------
    def queue(self, name: str, shard: int | None = None) -> str:
        """The stream of queue ``name`` (of ``shard`` in the cluster layout: required there)."""
        if self.shards and shard is None:
            raise ValueError(f"queue {name[:100]!r}: the cluster layout ({self.shards} shards) needs a shard")
        return f"{self._base(shard)}:queue:{name}"

    def queue_for(self, name: str, job_id: str) -> str:
        """The stream of queue ``name`` that holds the entry of job ``job_id``."""
        return self.queue(name, self.shard_of(job_id))

    def queue_streams(self, name: str) -> list[str]:
        """Every stream of queue ``name``: one per shard (one in the single-node layout)."""
        return [self.queue(name, shard) for shard in self.shard_range()]

    def job(self, job_id: str) -> str:
        return f"{self._of_job(job_id)}:job:{job_id}"

    def job_id_of(self, key: str) -> str | None:
        """The id in a job hash's key (the inverse of ``job``), or None for another key."""
        head = f"{self.prefix}:"
        if not key.startswith(head):
            return None
        rest = key[len(head):]
        if self.shards:  # "{sK}:job:{id}"
            tag, sep, rest = rest.partition("}:")
            if not sep or not tag.startswith("{s"):
                return None
        if not rest.startswith("job:") or len(rest) == 4:
            return None
        job_id = rest[4:]
        return job_id if self.job(job_id) == key else None

    def done(self, job_id: str) -> str:
        return f"{self._of_job(job_id)}:done:{job_id}"

    def tokens(self, job_id: str) -> str:
        return f"{self._of_job(job_id)}:tokens:{job_id}"

    def cancel(self, job_id: str) -> str:
        return f"{self._of_job(job_id)}:cancel:{job_id}"

    @property
    def dead(self) -> str:
        """The dead letter stream (of the single-node layout; ``dead_of`` a shard for the cluster's)."""
        return self.dead_of(None if not self.shards else 0)

    def dead_of(self, shard: int | None) -> str:
        return f"{self._base(shard)}:dead"

    def dead_for(self, job_id: str) -> str:
        return self.dead_of(self.shard_of(job_id))

    def outstanding(self, tenant: str) -> str:
        """Sorted set: the OpenAI gateway's requests of one tenant not yet answered (job id ->
        the unix time after which the entry no longer counts, should its gateway die)."""
        return f"{self.prefix}:gateway:outstanding:{tenant}"

    @property
    def workers(self) -> str:
        """Hash: worker name -> JSON heartbeat (host, pid, in flight, last seen)."""
        return f"{self.prefix}:workers"

    @property
    def layout(self) -> str:
        """String: the layout the workers run (``shards=N``), so a worker of another layout refuses to start."""
        return f"{self.prefix}:layout"


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
    if not _ID_RE.fullmatch(job_id):
        raise ValueError(f"id {job_id!r} may hold only letters, digits and . _ : @ -")
    return job_id


def check_queue_name(name: Any) -> str:
    """``name`` if it is a valid queue name (the same characters as an id), else ``ValueError``."""
    if not isinstance(name, str) or not name or len(name) > MAX_ID_LENGTH or not _ID_RE.fullmatch(name):
        raise ValueError(
            f"queue name must be 1-{MAX_ID_LENGTH} letters, digits and . _ : @ -, got {name!r}"
        )
    return name
