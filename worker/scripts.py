"""The worker's side of the protocol's scripts: ``Scripts`` registers them on a client and
spells out each one's key and argument lists.

The Lua itself, and why every change to a job's state is one atomic, fenced, all-or-nothing
script, is in ``producers/protocol/worker_scripts.py``.
"""

from __future__ import annotations

import redis

from producers.protocol import CONSUMER_GROUP, Keys, entry_ref
from producers.protocol.error_codes import ErrorCode
from producers.protocol.worker_scripts import APPEND, DEAD, FINISH, HEARTBEAT, START, WRITE
from producers.scripting import register

RELEASE_IDLE_MS = 7 * 24 * 3600 * 1000  # older than any sane --claim-idle-seconds
MAX_ERROR_CHARS = 500
DELTA_ARGS = 7  # arguments per token delta in WRITE and APPEND: index ... logprobs, prompt


def storable(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters, with anything Redis cannot hold escaped."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."


def encode(value) -> bytes:
    """A script argument as bytes; ``UnicodeEncodeError`` for text Redis cannot hold (a lone
    surrogate), raised here, by the one caller, instead of inside a whole pipeline's send."""
    if isinstance(value, bytes):
        return value
    return (value if isinstance(value, str) else str(value)).encode("utf-8")


def _code(code: ErrorCode | None) -> str:
    return code.value if code is not None else ""


class Scripts:
    """The scripts registered on one client, with their key lists spelled out once."""

    def __init__(self, client: redis.Redis, keys: Keys, worker: str, group: str = CONSUMER_GROUP) -> None:
        self.keys = keys
        self.worker = worker
        self.group = group
        self._start = register(client, START)
        self._finish = register(client, FINISH)
        self._write = register(client, WRITE)
        self._append = register(client, APPEND)
        self._dead = register(client, DEAD)
        self._heartbeat = register(client, HEARTBEAT)

    def _job_keys(self, job_id: str, queue: str) -> list[str]:
        k = self.keys
        return [k.job(job_id), k.done(job_id), k.tokens(job_id), k.cancel(job_id), k.queue_for(queue, job_id),
                k.dead_for(job_id)]

    def _call(self, script, pipe, keys: list, args: list):
        return script(keys=keys, args=[encode(a) for a in args], client=pipe)

    def start(self, pipe, *, job_id: str, queue: str, entry_id: str, now: float, enqueued_at: float,
              max_attempts: int, ttl: int, stream: bool, raw: str):
        args = [self.group, entry_id, self.worker, repr(now), repr(enqueued_at), queue, max_attempts, ttl,
                "1" if stream else "0", raw, job_id, entry_ref(queue, entry_id)]
        return self._call(self._start, pipe, self._job_keys(job_id, queue), args)

    def finish(self, pipe, *, job_id: str, queue: str, entry_id: str | None, status: str, now: float, ttl: int,
               stream: bool, result: str = "", error: str = "", finish_reason: str = "", dead_raw: str = "",
               code: ErrorCode | None = None):
        """End a job no run of this worker owns (invalid, or expired before it started)."""
        args = [self.group, entry_id or "", status, result, error, repr(now), ttl, self.worker,
                "1" if stream else "0", finish_reason, dead_raw, queue, job_id, entry_ref(queue, entry_id or ""),
                _code(code)]
        return self._call(self._finish, pipe, self._job_keys(job_id, queue), args)

    def write(self, pipe, *, job_id: str, queue: str, entry_id: str, attempt: int, now: float, ttl: int,
              stream: bool, deltas: list[tuple] = (), end: str = "", status: str = "", result: bytes | str = "",
              error: str = "", finish_reason: str = "", code: ErrorCode | None = None, progress: str = ""):
        """One run's writes of a round, fenced on its owner token (see ``WRITE``); ``deltas`` are
        ``(index, offset, text, token_ids JSON, finish_reason or '', logprobs JSON or '', prompt JSON
        or '')`` tuples (the last ones may be left off); ``progress`` is the run's checkpoint (JSON, '' for none)."""
        args = [self.group, entry_id, self.worker, attempt, entry_ref(queue, entry_id), repr(now), ttl,
                "1" if stream else "0", end, status, result, error, finish_reason, RELEASE_IDLE_MS, _code(code),
                progress]
        for delta in deltas:
            args.extend(tuple(delta) + ("",) * (DELTA_ARGS - len(delta)))
        return self._call(self._write, pipe, self._job_keys(job_id, queue), args)

    def append_part(self, *, job_id: str, queue: str, entry_id: str, attempt: int, deltas: list[tuple] = (),
                    progress: str = "") -> tuple[list[str], list[bytes]]:
        """One run's share of an ``append`` call (its keys, its encoded arguments): its deltas and
        its checkpoint, as ``write`` takes them; ``UnicodeEncodeError`` here for text Redis cannot hold."""
        args = [encode(attempt), encode(entry_ref(queue, entry_id)), encode(progress), encode(len(deltas))]
        for delta in deltas:
            args += [a.encode() if type(a) is str else encode(a) for a in delta]  # NOTE: a call per token
            args += [b""] * (DELTA_ARGS - len(delta))
        k = self.keys
        return [k.job(job_id), k.done(job_id), k.tokens(job_id)], args

    def append(self, pipe, parts: list[tuple[list[str], list[bytes]]], *, ttl: int):
        """The writes of many runs that neither end nor are released, all of one shard, in one
        call (see ``APPEND``), each fenced as ``write`` fences it; one code per part."""
        keys: list[str] = []
        args = [encode(self.worker), encode(ttl)]
        for part_keys, part_args in parts:
            keys += part_keys
            args += part_args
        return self._append(keys=keys, args=args, client=pipe)

    def dead(self, pipe, *, queue: str, entry_id: str, raw: str, error: str, now: float,
             code: ErrorCode | None = None, shard: int | None = None):
        """Dead-letter an entry of ``queue`` (of ``shard``: the stream it was read from)."""
        args = [self.group, entry_id, raw, error, queue, self.worker, repr(now), _code(code)]
        return self._call(self._dead, pipe, [self.keys.dead_of(shard), self.keys.queue(queue, shard)], args)

    def heartbeat(self, pipe, *, queue: str, runs: list[tuple[str, str, int]]):
        """Beat ``runs`` of ``queue``, each ``(job id, entry id, attempt)``, all of one shard (the
        caller groups them: ``shard_of``); one code per run."""
        keys = [self.keys.queue_for(queue, runs[0][0])] + [self.keys.job(job_id) for job_id, _, _ in runs]
        args = [self.group, self.worker]
        for _, entry_id, attempt in runs:
            args += [entry_id, attempt, entry_ref(queue, entry_id)]
        return self._call(self._heartbeat, pipe, keys, args)

