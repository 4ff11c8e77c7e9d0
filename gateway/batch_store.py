"""Files and batches of the OpenAI Batch API, kept in Redis (keys: ``producers.protocol.batch_keys``).

A file is a hash (its OpenAI object and where its bytes are) and its bytes: a Redis string
for an upload within ``max_file_bytes``, a file in the shared ``files_dir`` for a larger one,
or the list of lines a batch wrote (its output and error files). Every read names the tenant
and a file or batch of another tenant is answered 404, as one that does not exist; so is a
file past its ``expires_at``, until ``sweep_expired`` deletes it, and a hash that is not a
whole record, of a file (``whole_file``; its tenant may still delete it: ``deletable_meta``) or
of a batch (``whole_batch``; both in ``gateway.batch_records``); lists leave these out. A gateway without ``files_dir`` answers a
read or delete of a file kept there 503 (``path``), and leaves it as it is.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

import redis.asyncio as aioredis

from gateway.batch_records import (
    DIRECTORY,
    LINES,
    REDIS,
    batch_object,
    expired,
    file_object,
    only_batch_field,
    output_of,
    visible,
    whole_batch,
    whole_file,
)
from gateway.batch_settings import BatchSettings
from gateway.errors import APIError, InvalidRequest
from producers.protocol import Keys
from producers.protocol.batch_keys import BatchKeys
from producers.protocol.batch_statuses import BATCH_ENDED
from producers.protocol.limits import abbreviate

CHUNK = 2**20  # bytes moved at a time between an upload, Redis and a download
LIST_CHUNK = 1000  # lines of an output file read at a time
SWEEP_CHUNK = 100  # expired files deleted by one sweep
SWEEP_RETRY_S = 60.0  # how long an expired file still read by a running batch waits for the next look
PURPOSES = ("batch", "batch_output")


def new_id(kind: str) -> str:
    return f"{kind}-{secrets.token_hex(16)}"  # 128 random bits: nobody lists another tenant's ids


class Store:
    """Reads and writes files and batch objects for one tenant at a time."""

    def __init__(self, redis: aioredis.Redis, raw: aioredis.Redis, prefix: str, settings: BatchSettings,
                 queue_shards: int = 0) -> None:
        self.redis = redis  # decode_responses=True
        self.raw = raw  # the same server, bytes in and out (file contents)
        self.keys = BatchKeys(prefix)
        self.jobs = Keys(prefix, queue_shards)  # the keys of the batch's jobs (protocol v1's)
        self.settings = settings

    # -- files ------------------------------------------------------------------------------

    async def put_upload(self, tenant: str, filename: str, purpose: str, upload: BinaryIO,
                         expires_after: int | None = None) -> dict[str, Any]:
        """Store an upload (a spooled file) and return its file object; 413 past the limits.
        ``expires_after``: seconds from its creation to its expiry (None: ``default_expires_after``)."""
        if purpose != "batch":
            raise InvalidRequest("purpose", f"purpose: only 'batch' files are accepted here, got {abbreviate(purpose)}")
        if expires_after is None:  # as OpenAI's: a batch file expires after 30 days unless it says otherwise
            expires_after = self.settings.default_expires_after or None
        size = upload.seek(0, os.SEEK_END)
        upload.seek(0)
        limit = self.settings.max_file_bytes
        if await self.redis.zcard(await self.files_index(tenant)) >= self.settings.max_files_per_tenant:
            raise APIError(429, f"this tenant holds {self.settings.max_files_per_tenant:,} files, the limit"
                                " (SLUICEWAY_BATCH_MAX_FILES_PER_TENANT); delete some first", code="too_many_files")
        file_id = new_id("file")
        if size <= limit:
            storage = REDIS
            data_key = self.keys.file_data(file_id)
            while chunk := upload.read(CHUNK):
                await self.raw.append(data_key, chunk)
        elif self.settings.files_dir and size <= self.settings.max_dir_file_bytes:
            storage = DIRECTORY
            _copy_to(upload, self.path(file_id))
        else:
            dir_limit = f" and {self.settings.max_dir_file_bytes:,} in files_dir" if self.settings.files_dir else \
                " (set SLUICEWAY_BATCH_FILES_DIR for larger files)"
            raise APIError(413, f"file: {filename!r} is {size:,} bytes; the limit is {limit:,} bytes in Redis"
                                f" (SLUICEWAY_BATCH_MAX_FILE_BYTES){dir_limit}", param="file", code="file_too_large")
        return await self._record(tenant, file_id, filename, purpose, size, storage, expires_after=expires_after)

    async def _record(self, tenant: str, file_id: str, filename: str, purpose: str, size: int, storage: str,
                      lines: str = "", expires_after: int | None = None) -> dict[str, Any]:
        now = int(time.time())
        expires_at = now + expires_after if expires_after is not None else None
        fields = {"id": file_id, "tenant": tenant, "bytes": size, "created_at": now, "filename": filename,
                  "purpose": purpose, "storage": storage, "lines": lines,
                  "expires_at": expires_at if expires_at is not None else ""}
        # NOTE: not a transaction: the keys are in different Cluster slots; the hash comes first,
        # so a listing never names a file without one (a listing skips an id without a hash).
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.file(file_id), mapping=fields)
            pipe.zadd(self.keys.files(tenant), {file_id: time.time()})  # NOTE: not the whole second: order within one
            if expires_at is not None:
                pipe.zadd(self.keys.expiring_files, {file_id: expires_at})
            await pipe.execute()
        return file_object(fields)

    async def record_file(self, tenant: str, file_id: str, filename: str, size: int, storage: str,
                          expires_after: int | None = None) -> None:
        """Record a batch's output or error file already written to ``files_dir`` (idempotent)."""
        await self._record(tenant, file_id, filename, "batch_output", size, storage, expires_after=expires_after)

    async def put_lines(self, tenant: str, file_id: str, filename: str, lines_key: str, size: int,
                        expires_after: int | None = None) -> None:
        """Record a batch's output or error list as a file (idempotent: its id is the batch's).

        NOTE: with ``files_dir`` the lines are copied there, and the list is deleted once the
        batch has ended (``drop_lines``): a finished batch's answers then leave Redis."""
        if not self.settings.files_dir:
            await self._record(tenant, file_id, filename, "batch_output", size, LINES, lines_key, expires_after)
            return
        path = self.path(file_id)
        tmp = path.with_name(path.name + ".part")
        path.parent.mkdir(parents=True, exist_ok=True)
        written, start = 0, 0
        with tmp.open("wb") as out:
            while lines := await self.raw.lrange(lines_key, start, start + LIST_CHUNK - 1):
                written += out.write(b"".join(lines))
                start += len(lines)
        os.replace(tmp, path)
        await self._record(tenant, file_id, filename, "batch_output", written, DIRECTORY, expires_after=expires_after)

    async def drop_lines(self, file_id: str, lines_key: str) -> None:
        """Delete an ended batch's list of lines unless it is still its file's bytes (``storage`` lines):
        ``put_lines`` has copied it to ``files_dir``, or the file was deleted before this clean-up."""
        meta = await self.redis.hgetall(self.keys.file(file_id))
        if meta.get("storage") != LINES or meta.get("lines") != lines_key:
            await self.redis.delete(lines_key)

    async def file_meta(self, tenant: str, file_id: str) -> dict[str, str]:
        meta = await self.redis.hgetall(self.keys.file(file_id)) if _plain_id(file_id) else {}
        if not visible(meta, tenant, time.time()):
            raise _file_not_found(file_id)
        return meta

    async def list_files(self, tenant: str, purpose: str | None, limit: int, after: str | None,
                         order: str) -> dict[str, Any]:
        data, more, now = [], False, time.time()
        async for file_id in self._ids(await self.files_index(tenant), after, order):
            meta = await self.redis.hgetall(self.keys.file(file_id))
            if not visible(meta, tenant, now) or (purpose is not None and meta.get("purpose") != purpose):
                continue
            if len(data) == limit:
                more = True
                break
            data.append(file_object(meta))
        return _page(data, more)

    async def files_index(self, tenant: str) -> str:
        """The key of ``tenant``'s files by time, once the ids an older gateway left under its old name are in it."""
        return await self._moved(self.keys.old_files(tenant), self.keys.files(tenant))

    async def batches_index(self, tenant: str) -> str:
        """The key of ``tenant``'s batches by time, as ``files_index``."""
        return await self._moved(self.keys.old_batches(tenant), self.keys.batches(tenant))

    async def _moved(self, old: str, key: str) -> str:
        """``key``, after moving into it the ids a gateway before the tenant segment kept under ``old``.

        NOTE: moved where they are read (one ZRANGE of an empty key after that), not once at
        start: a gateway not upgraded yet may go on adding to ``old`` meanwhile. The tenant
        ``active``'s old name was the active set's; none of its batches can have been kept there."""
        if old == self.keys.active:
            return key
        while pairs := await self.redis.zrange(old, 0, LIST_CHUNK - 1, withscores=True):
            await self.redis.zadd(key, dict(pairs))
            await self.redis.zrem(old, *(member for member, _ in pairs))
        return key

    async def _ids(self, key: str, after: str | None, order: str) -> AsyncIterator[str]:
        """A tenant's ids by time, newest first (``order`` desc) or oldest, after the id ``after``."""
        rank = await (self.redis.zrevrank(key, after) if order == "desc" else self.redis.zrank(key, after)) \
            if after is not None else -1
        if rank is None:  # an ``after`` this tenant does not have: nothing follows it
            return
        start = rank + 1
        while True:
            read = self.redis.zrevrange if order == "desc" else self.redis.zrange
            ids = await read(key, start, start + LIST_CHUNK - 1)
            for member in ids:
                yield member
            if len(ids) < LIST_CHUNK:
                return
            start += LIST_CHUNK

    def content(self, meta: dict[str, str]) -> AsyncIterator[bytes]:
        """A file's bytes, a chunk at a time (never the whole file in memory); the 503 of ``path``
        at once, before a byte is sent."""
        path = self.path(meta["id"]) if meta["storage"] == DIRECTORY else None
        return self._chunks(meta, path)

    async def _chunks(self, meta: dict[str, str], path: Path | None) -> AsyncIterator[bytes]:
        if meta["storage"] == REDIS:
            key, offset, size = self.keys.file_data(meta["id"]), 0, int(meta["bytes"])
            while offset < size:
                yield await self.raw.getrange(key, offset, min(size, offset + CHUNK) - 1)
                offset += CHUNK
        elif path is not None:
            with path.open("rb") as f:
                while chunk := f.read(CHUNK):
                    yield chunk
        else:
            start = 0
            while lines := await self.raw.lrange(meta["lines"], start, start + LIST_CHUNK - 1):
                yield b"".join(lines)
                start += len(lines)

    async def read_range(self, meta: dict[str, str], offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of an uploaded file from ``offset``."""
        if meta["storage"] == REDIS:
            return await self.raw.getrange(self.keys.file_data(meta["id"]), offset, offset + size - 1)
        with self.path(meta["id"]).open("rb") as f:
            f.seek(offset)
            return f.read(size)

    async def deletable_meta(self, tenant: str, file_id: str) -> dict[str, str]:
        """The hash of a file ``tenant`` may delete: one it may read, or a part of one (no hash at all
        included) that its index names and that names no other tenant, or one that holds nothing but
        the ``batch`` field of a batch of ``tenant``'s (``only_batch_field``); else 404.

        NOTE: a part of a record is answered 404 by every read, but its index entry counts toward
        ``max_files_per_tenant``: a tenant who could not delete it lost that place for good. A hash
        of a ``batch`` field alone stayed in Redis for good (its feeder drops it at validation,
        ``drop_left_behind``, unless the field lands after that)."""
        meta = await self.redis.hgetall(self.keys.file(file_id)) if _plain_id(file_id) else {}
        if visible(meta, tenant, time.time()):
            return meta
        if _plain_id(file_id) and not whole_file(meta) and (meta.get("tenant") or tenant) == tenant \
                and (await self._indexed(tenant, file_id) or await self._left_by(tenant, meta)):
            return {**meta, "id": file_id, "tenant": tenant}
        raise _file_not_found(file_id)

    async def _left_by(self, tenant: str, meta: dict[str, str]) -> bool:
        """Whether a file hash holds nothing but the ``batch`` field of a batch of ``tenant``'s."""
        batch_id = only_batch_field(meta)
        return batch_id is not None and _plain_id(batch_id) \
            and await self.redis.hget(self.keys.batch(batch_id), "tenant") == tenant

    async def drop_left_behind(self, file_id: str, batch_id: str) -> None:
        """Delete the hash of ``file_id`` when it holds nothing but the ``batch`` field ``batch_id``'s
        create wrote back after the file's delete (``only_batch_field``): the input gone, the batch fails.

        NOTE: read, then deleted: the only other writer of such a hash is a create that had read the
        file whole before its delete, whose own batch then finds no hash and fails all the same."""
        if only_batch_field(await self.redis.hgetall(self.keys.file(file_id))) == batch_id:
            await self.redis.delete(self.keys.file(file_id))

    async def _indexed(self, tenant: str, file_id: str) -> bool:
        """Whether ``tenant``'s index of files (or an older gateway's, not moved yet) holds ``file_id``."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zscore(self.keys.files(tenant), file_id)
            pipe.zscore(self.keys.old_files(tenant), file_id)
            return any(score is not None for score in await pipe.execute())

    async def delete_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        await self._remove(await self.deletable_meta(tenant, file_id))
        return {"id": file_id, "object": "file", "deleted": True}

    async def _remove(self, meta: dict[str, str]) -> None:
        """Delete a file: its hash first (it is answered 404 at once), then its bytes and index entries.
        Nothing is deleted where ``path`` refuses (the bytes are in a files_dir this gateway lacks).

        NOTE: a part of a record may not say where its bytes are (``storage`` missing, or of no known
        kind): wherever they may be is cleared, the Redis string and, with ``files_dir``, its file.

        NOTE: only keys its id derives: a batch's output or error list is the one its file's id names
        (``lines_key``), never whatever key the hash's ``lines`` field names; a hash written by hand,
        or a part of one, deleted any key so (a queue, another batch's answers)."""
        file_id, storage = meta["id"], meta.get("storage")
        unknown = storage not in (REDIS, DIRECTORY, LINES) and bool(self.settings.files_dir)
        path = self.path(file_id) if storage == DIRECTORY or unknown else None
        lines = self.lines_key(file_id) if storage not in (REDIS, DIRECTORY) else None
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.file(file_id), self.keys.file_data(file_id))
            if lines is not None:
                pipe.delete(lines)
            pipe.zrem(self.keys.files(meta["tenant"]), file_id)
            pipe.zrem(self.keys.old_files(meta["tenant"]), file_id)  # an older gateway's entry not moved yet
            pipe.zrem(self.keys.expiring_files, file_id)
            await pipe.execute()
        if path is not None:
            path.unlink(missing_ok=True)

    async def sweep_expired(self) -> int:
        """Delete the files whose ``expires_at`` has passed, up to ``SWEEP_CHUNK`` a call; the number deleted.

        NOTE: the input of a running batch keeps its bytes until the batch ends (it is answered
        404 from its expiry on all the same): deleted under the batch, it failed every pass on
        its missing input. Its next look is ``SWEEP_RETRY_S`` later, so it never holds up the rest."""
        now = time.time()
        due = await self.redis.zrangebyscore(self.keys.expiring_files, "-inf", now, start=0, num=SWEEP_CHUNK)
        if not due:
            return 0
        inputs = await self._running_inputs()
        removed = 0
        for file_id in due:
            meta = await self.redis.hgetall(self.keys.file(file_id))
            if not whole_file(meta) or not meta.get("expires_at"):  # deleted (by its tenant, another sweep)
                await self.redis.zrem(self.keys.expiring_files, file_id)
            elif not expired(meta, now):  # the index is only a schedule: the hash's expires_at decides
                await self.redis.zadd(self.keys.expiring_files, {file_id: float(meta["expires_at"])})
            elif file_id in inputs or (meta.get("storage") == DIRECTORY and not self.settings.files_dir):
                # kept for now: a running batch reads it, or its bytes are in a files_dir this gateway lacks
                await self.redis.zadd(self.keys.expiring_files, {file_id: now + SWEEP_RETRY_S})
            else:
                await self._remove(meta)
                removed += 1
        return removed

    async def running_batch_of(self, file_id: str) -> str | None:
        """A batch not ended yet whose input is ``file_id`` (None when there is none)."""
        return (await self._running_inputs()).get(file_id)

    async def _running_inputs(self) -> dict[str, str]:
        """The input file of each batch not ended yet -> that batch (the first by id of several).

        NOTE: every active batch is looked at, not the file's ``batch`` field: that names only
        the last batch created on the file, and an earlier one may still be running on it. One that
        has ended is not, though it stays in the active set until its feeder's next pass cleans it
        up: nothing reads its input any more, and a delete right after retrieve answered its end was a 409."""
        active = sorted(await self.redis.smembers(self.keys.active))
        async with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in active:
                pipe.hmget(self.keys.batch(batch_id), ["input_file_id", "status"])
            inputs = await pipe.execute() if active else []
        running: dict[str, str] = {}
        for batch_id, (input_id, status) in zip(active, inputs):
            if input_id is not None and status not in BATCH_ENDED:
                running.setdefault(input_id, batch_id)
        return running

    def lines_key(self, file_id: str) -> str | None:
        """The list a batch's output or error file kept in Redis reads, as the file's id derives it
        (``output_of``); None for an upload's id."""
        found = output_of(file_id)
        if found is None:
            return None
        batch_id, kind = found
        return self.keys.output(batch_id) if kind == "output" else self.keys.errors(batch_id)

    def path(self, file_id: str) -> Path:
        """Where a file kept in ``files_dir`` lies (an upload, or a batch's output or error file).

        NOTE: a gateway without ``files_dir`` cannot reach such a file, and says so (503, naming the
        setting: another gateway may serve it); it read and deleted a file of that name in its
        working directory, and a delete dropped the record, the real bytes left behind for good."""
        if not self.settings.files_dir:
            raise APIError(503, f"file {file_id} keeps its bytes in files_dir, which this gateway has not set"
                                " (SLUICEWAY_BATCH_FILES_DIR: the same directory on every gateway); send this to a"
                                " gateway that sets it", param="file_id", code="files_dir_not_set")
        return Path(self.settings.files_dir) / file_id

    # -- batches ----------------------------------------------------------------------------

    async def batch_meta(self, tenant: str, batch_id: str) -> dict[str, str]:
        meta = await self.redis.hgetall(self.keys.batch(batch_id)) if _plain_id(batch_id) else {}
        if not whole_batch(meta) or meta.get("tenant") != tenant:
            raise APIError(404, f"No such Batch object: {abbreviate(batch_id)}", param="batch_id",
                           code="batch_not_found")
        return meta

    async def list_batches(self, tenant: str, limit: int, after: str | None) -> dict[str, Any]:
        data, more = [], False
        async for batch_id in self._ids(await self.batches_index(tenant), after, "desc"):
            meta = await self.redis.hgetall(self.keys.batch(batch_id))
            if not whole_batch(meta) or meta.get("tenant") != tenant:
                continue
            if len(data) == limit:
                more = True
                break
            data.append(batch_object(meta))
        return _page(data, more)


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _file_not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {abbreviate(file_id)}", param="file_id", code="file_not_found")


def _copy_to(upload: BinaryIO, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    with tmp.open("wb") as out:
        while chunk := upload.read(CHUNK):
            out.write(chunk)
    os.replace(tmp, path)


def _plain_id(value: str) -> bool:
    return 0 < len(value) <= 80 and value.replace("-", "").replace("_", "").isalnum()
