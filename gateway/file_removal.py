"""Deleting the Batch API's files (``gateway.batch_store`` keeps them): a tenant's delete
(``DELETE /v1/files``: ``deletable_meta``, then ``delete_file`` unless ``running_batch_of``
names a batch still reading it), the feeder's expiry sweep (``sweep_expired``, each pass) and
its clean-up of a file hash a racing create left behind (``drop_left_behind``).
"""

from __future__ import annotations

import time

from gateway.batch_records import DIRECTORY, LINES, REDIS, expired, only_batch_field, output_of, visible, whole_file
from gateway.batch_store import Store, file_not_found, plain_id
from producers.protocol.batch_statuses import BATCH_ENDED

SWEEP_CHUNK = 100  # expired files deleted by one sweep
SWEEP_RETRY_S = 60.0  # how long an expired file still read by a running batch waits for the next look


class FileRemoval:
    """Deletes the files of one ``Store``: one a tenant may delete, and those whose expiry has passed."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.redis = store.redis
        self.keys = store.keys
        self.settings = store.settings

    async def deletable_meta(self, tenant: str, file_id: str) -> dict[str, str]:
        """The hash of a file ``tenant`` may delete: one it may read, or a part of one (no hash at all
        included) that its index names and that names no other tenant, or one that holds nothing but
        the ``batch`` field of a batch of ``tenant``'s (``only_batch_field``); else 404.

        NOTE: a part of a record is answered 404 by every read, but its index entry counts toward
        ``max_files_per_tenant``: a tenant who could not delete it lost that place for good. A hash
        of a ``batch`` field alone stayed in Redis for good (its feeder drops it at validation,
        ``drop_left_behind``, unless the field lands after that)."""
        meta = await self.redis.hgetall(self.keys.file(file_id)) if plain_id(file_id) else {}
        if visible(meta, tenant, time.time()):
            return meta
        if plain_id(file_id) and not whole_file(meta) and (meta.get("tenant") or tenant) == tenant \
                and (await self._indexed(tenant, file_id) or await self._left_by(tenant, meta)):
            return {**meta, "id": file_id, "tenant": tenant}
        raise file_not_found(file_id)

    async def _left_by(self, tenant: str, meta: dict[str, str]) -> bool:
        """Whether a file hash holds nothing but the ``batch`` field of a batch of ``tenant``'s."""
        batch_id = only_batch_field(meta)
        return batch_id is not None and plain_id(batch_id) \
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
        path = self.store.path(file_id) if storage == DIRECTORY or unknown else None
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

