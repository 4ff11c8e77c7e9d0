"""Files and batches of the OpenAI Batch API, kept in Redis (keys: ``producers.protocol.batch_keys``).

A file is a hash (its OpenAI object and where its bytes are) and its bytes: a Redis string
for an upload within ``max_file_bytes``, a file in the shared ``files_dir`` for a larger one,
or the list of lines a batch wrote (its output and error files). Every read names the tenant
and a file or batch of another tenant is answered 404, as one that does not exist; so is a
file past its ``expires_at``, until the expiry sweep deletes it, and a hash that is not a
whole record, of a file (``whole_file``; its tenant may still delete it) or of a batch
(``whole_batch``; both in ``gateway.batch_records``); lists leave these out. A gateway without
``files_dir`` answers a read or delete of a file kept there 503 (``path``), and leaves it as it is.
Deletes and the expiry sweep are ``gateway.file_removal``'s ``FileRemoval``.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

import redis.asyncio as aioredis

from gateway.batch_records import DIRECTORY, LINES, REDIS, batch_object, file_object, visible, whole_batch
from gateway.batch_settings import BatchSettings
from gateway.errors import APIError, InvalidRequest
from producers.protocol import Keys
from producers.protocol.batch_keys import BatchKeys
from producers.protocol.limits import abbreviate

CHUNK = 2**20  # bytes moved at a time between an upload, Redis and a download
LIST_CHUNK = 1000  # lines of an output file read at a time
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
        meta = await self.redis.hgetall(self.keys.file(file_id)) if plain_id(file_id) else {}
        if not visible(meta, tenant, time.time()):
            raise file_not_found(file_id)
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
        meta = await self.redis.hgetall(self.keys.batch(batch_id)) if plain_id(batch_id) else {}
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


def file_not_found(file_id: str) -> APIError:
    """The 404 of a file that does not exist or that the tenant may not see."""
    return APIError(404, f"No such File object: {abbreviate(file_id)}", param="file_id", code="file_not_found")


def _copy_to(upload: BinaryIO, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    with tmp.open("wb") as out:
        while chunk := upload.read(CHUNK):
            out.write(chunk)
    os.replace(tmp, path)


def plain_id(value: str) -> bool:
    """Whether ``value`` has the shape of an id (up to 80 letters, digits, ``-`` and ``_``);
    a read of any other is answered 404 without a look in Redis."""
    return 0 < len(value) <= 80 and value.replace("-", "").replace("_", "").isalnum()
