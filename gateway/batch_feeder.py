"""The feeder: whichever gateway holds a batch's lease validates it, feeds its lines to the
queue with at most ``max_outstanding`` jobs in flight, collects their ends and finalizes it.

The lease is a Redis key with a TTL that its holder renews on every pass; a gateway that dies
(kill -9) stops renewing and another one (every gateway scans the active set) takes the batch
over after ``lease_seconds``. Nothing is lost or done twice: a line's job ids are the batch id
and the line number (and a prompt's index past the first), so a line fed again after a takeover
submits nothing new (``SUBMIT_SCRIPT`` skips a known id); a line is answered exactly once, when
all of its jobs have ended (``ANSWER_LINE_SCRIPT``);
and the cursor (byte offset and line number of the next line to feed) is stored after each
chunk of lines, so a new holder re-reads at most one chunk.

Every pass of the scan also deletes the files whose expiry has passed (``FileRemoval.sweep_expired``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.batch_answers import DIR, cut_to_record, truncate
from gateway.batch_answers import LINES as IN_REDIS
from gateway.batch_input import file_lines, scan
from gateway.batch_lines import BatchLines, Unspoken
from gateway.batch_settings import BatchSettings
from gateway.batch_records import DIRECTORY, LINES, output_file_id, whole_batch, whole_file
from gateway.batch_store import Store
from gateway.errors import unexpected_error
from gateway.file_removal import FileRemoval
from gateway.shutdown import STOP_WAIT_S, bounded, cancel
from producers.protocol.batch_statuses import BATCH_ENDED, BatchStatus
from producers.protocol.batch_scripts import (
    CANCEL_BATCH_SCRIPT,
    MOVE_BATCH_SCRIPT,
    RELEASE_LEASE_SCRIPT,
    RENEW_LEASE_SCRIPT,
)
from producers.scripting import register

log = logging.getLogger("sluiceway.gateway.batches")
VALIDATING, IN_PROGRESS = BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value
FINALIZING, CANCELLING = BatchStatus.FINALIZING.value, BatchStatus.CANCELLING.value
EXPIRING = -1  # ``Feeder.cancel``'s answer for a batch past its completion window


class Feeder:
    """Runs every active batch this gateway holds the lease of; ``start`` / ``stop``."""

    def __init__(self, store: Store, removal: FileRemoval, settings: BatchSettings, translate: Callable,
                 result_body: Callable, queue_of: Callable[[str | None], Awaitable[str | None]],
                 unspoken_of: Unspoken) -> None:
        self.store = store
        self.removal = removal
        self.redis = store.redis
        self.keys = store.keys
        self.settings = settings
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.lines = BatchLines(store, settings, translate, result_body, queue_of, unspoken_of, self.holder)
        self._renew = register(self.redis, RENEW_LEASE_SCRIPT)
        self._move = register(self.redis, MOVE_BATCH_SCRIPT)
        self._cancel = register(self.redis, CANCEL_BATCH_SCRIPT)
        self._release = register(self.redis, RELEASE_LEASE_SCRIPT)
        self._tasks: dict[str, asyncio.Task] = {}
        # batches whose lease this gateway took and has not given up: with a task, or between a
        # task that failed and the pass that takes the batch up again (released at stop)
        self._leased: set[str] = set()
        # batches whose answers or input are in a files_dir this gateway lacks: skipped by the scan
        # (held, each pass logged an error and released it) until they leave the active set
        self._refused: set[str] = set()
        self._scanner: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> None:
        self._scanner = asyncio.create_task(self._scan_loop())

    async def stop(self) -> None:
        self._stopping = True
        # NOTE: bounded: a gateway that never exits is worse than a lost task. Its batch is handed
        # on all the same: the process ends with this stop, and a line answered twice is answered
        # once (the answered bitmap)
        pending = await cancel([t for t in (self._scanner, *self._tasks.values()) if t is not None], STOP_WAIT_S)
        if pending:
            log.warning("%d batch task(s) still running %.0f s after their cancel; shutting down without them",
                        len(pending), STOP_WAIT_S)
        for batch_id in sorted(self._leased):  # hand the batches on at once rather than after the TTL
            # NOTE: Redis away or slow: the lease runs out on its own
            await bounded(self._release(keys=[self.keys.lease(batch_id)], args=[self.holder]),
                          f"releasing batch {batch_id}'s lease")

    async def _scan_loop(self) -> None:
        lease_ms = int(self.settings.lease_seconds * 1000)
        while True:
            self._stopped_yet()
            try:
                active = await self.redis.smembers(self.keys.active)
                # NOTE: a refused batch is forgotten once it has left the active set (ended by a gateway
                # with files_dir, or its record gone): kept, the set grew by one a batch for good
                self._refused &= active
                for batch_id in active:
                    if batch_id in self._tasks or batch_id in self._refused:
                        continue
                    # NOTE: or still ours: a pass that failed (Redis away a moment) is taken up again at once
                    if await self.redis.set(self.keys.lease(batch_id), self.holder, nx=True, px=lease_ms) \
                            or await self.renew(batch_id):
                        self._leased.add(batch_id)
                        self._tasks[batch_id] = asyncio.create_task(self._hold(batch_id))
                # NOTE: every gateway sweeps, each pass: one ZRANGEBYSCORE while nothing is due
                await self.removal.sweep_expired()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NOTE: Redis away: try again next pass; the batches wait in Redis
                error = unexpected_error(exc)
                if error.status == 503:  # one line a pass, as a request answered 503 logs, not a traceback each
                    log.warning("batch scan: %s", error.message)
                else:
                    log.exception("batch scan failed")
            await asyncio.sleep(self.settings.poll_seconds)

    async def _hold(self, batch_id: str) -> None:
        try:
            await self._run(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: feeder stopped; another pass takes it up again", batch_id)
        finally:
            self._tasks.pop(batch_id, None)
            self.lines.forget(batch_id)

    def _stopped_yet(self) -> None:
        """Raise the cancel of a ``stop`` that a pass of this task lost (``gateway.shutdown.cancel``
        says how): each pass looks, so the loop ends at its next pass all the same."""
        if self._stopping:
            raise asyncio.CancelledError

    async def renew(self, batch_id: str) -> bool:
        ms = int(self.settings.lease_seconds * 1000)
        return bool(await self._renew(keys=[self.keys.lease(batch_id)], args=[self.holder, ms]))

    async def move(self, batch_id: str, status: str, time_field: str, *from_: str, **fields: Any) -> bool:
        extra = [x for kv in fields.items() for x in kv]
        args = [status, time_field, repr(time.time()), *from_, "--", *extra]
        return bool(await self._move(keys=[self.keys.batch(batch_id)], args=args))

    async def cancel(self, batch_id: str) -> int:
        """Move a batch validating or in_progress to cancelling: 1 when it moved, 0 when it had another
        status, ``EXPIRING`` when its completion window has passed (it ends expired, not cancelled)."""
        args = [repr(time.time()), CANCELLING, VALIDATING, IN_PROGRESS]
        return int(await self._cancel(keys=[self.keys.batch(batch_id)], args=args))

    # -- one batch --------------------------------------------------------------------------

    async def _run(self, batch_id: str) -> None:
        meta = await self.redis.hgetall(self.keys.batch(batch_id))
        unreachable = await self._in_files_dir(meta) if not self.settings.files_dir else None
        if unreachable:
            # NOTE: left to a gateway that can reach it: held here, it stalled (a 503 each pass, the
            # lease renewed), and a mixed deployment never ran it
            log.error("batch %s keeps %s in files_dir, which this gateway has not set; left to others",
                      batch_id, unreachable)
            self._refused.add(batch_id)
            await self._release(keys=[self.keys.lease(batch_id)], args=[self.holder])
            self._leased.discard(batch_id)
            return
        if self._not_whole(batch_id, meta):
            await self._clean(batch_id)
            return
        await cut_to_record(self.lines, batch_id, meta)  # a killed holder's bytes past the record
        while await self.renew(batch_id):
            self._stopped_yet()
            meta = await self.redis.hgetall(self.keys.batch(batch_id))
            status = meta.get("status")
            if not meta or status in BATCH_ENDED or self._not_whole(batch_id, meta):
                await self._clean(batch_id)
                return
            if status == BatchStatus.VALIDATING.value:
                await self._validate(batch_id, meta)
                continue
            if status == BatchStatus.FINALIZING.value:
                await self._finalize(batch_id, meta)
                continue
            await self.lines.collect(batch_id, meta)
            stop = meta.get("stop") or ""
            if not stop and time.time() > float(meta["expires_at"]):
                # NOTE: HSETNX: a cancel that landed since meta was read (before expires_at) stands
                await self.redis.hsetnx(self.keys.batch(batch_id), "stop", "expire")
                continue
            if stop:
                if meta.get("cancel_sent") != "1":
                    await self.lines.cancel_pending(batch_id)
                if not await self.redis.hlen(self.keys.pending(batch_id)):
                    if status == CANCELLING:
                        # NOTE: as OpenAI's: cancelling -> cancelled, never finalizing between (a client
                        # waiting out cancelling took finalizing for the end, with no files yet).
                        # Read again: the byte counts grew by the lines just collected
                        await self._finalize(batch_id, await self.redis.hgetall(self.keys.batch(batch_id)))
                    else:
                        await self.move(batch_id, FINALIZING, "finalizing_at", IN_PROGRESS)
                    continue
            else:
                fed = await self.lines.fill(batch_id, meta)
                if not fed and not await self.redis.hlen(self.keys.pending(batch_id)):
                    await self.move(batch_id, FINALIZING, "finalizing_at", IN_PROGRESS)
                    continue
            # NOTE: every pass reads the state of every job in flight, so passes are paced, not
            # spun: at most max_outstanding / poll_seconds reads a second, whatever the load.
            await asyncio.sleep(self.settings.poll_seconds)
        self._leased.discard(batch_id)  # the lease ran out (this loop stalled past it): another holds it

    @staticmethod
    def _not_whole(batch_id: str, meta: dict[str, str]) -> bool:
        """Whether a batch hash still there is no whole record (whole_batch): no batch, as retrieve
        and list answer (404, left out), so it leaves the active set as one whose hash is gone.

        NOTE: held, it failed each pass on the field it lacks (a traceback a pass, the lease renewed)"""
        if not meta or meta.get("status") in BATCH_ENDED or whole_batch(meta):
            return False
        log.error("batch %s: its record is not whole (a field missing or not of its kind); no batch, so it leaves "
                  "the active set", batch_id)
        return True

    async def _in_files_dir(self, meta: dict[str, str]) -> str | None:
        """What of a batch lies in files_dir (its answers, or the input file it reads), None when nothing."""
        if meta.get("answers") == DIR:
            return "its answers"
        input_id = meta.get("input_file_id")
        if input_id and await self.redis.hget(self.keys.file(input_id), "storage") == DIRECTORY:
            return f"its input file {input_id}"
        return None

    async def _validate(self, batch_id: str, meta: dict[str, str]) -> None:
        file_meta, read = await self.lines.input(meta)
        # NOTE: a hash that is not a whole record is gone too: a create racing a delete writes the
        # file's ``batch`` field back into a hash the delete has just removed (dropped here: no
        # index names it, so it stayed for good)
        if not whole_file(file_meta) or file_meta.get("storage") == LINES:
            await self.removal.drop_left_behind(meta["input_file_id"], batch_id)
            await self._fail(batch_id, "invalid_file", "the input file is gone (deleted before the batch ran)")
            return
        lines = file_lines(read, int(file_meta["bytes"]), max_bytes=self.settings.max_line_bytes)
        found = await scan(lines, lambda: self.renew(batch_id))
        if found is None:
            return
        if found.rows == 0 or found.objects == 0:
            reason = found.first_problem or "the file holds no lines"
            await self._fail(batch_id, "invalid_file", f"the input file is not JSONL: {reason}")
            return
        limit = self.settings.max_rows_in_redis
        if not self.settings.files_dir and found.rows > limit:
            await self._fail(batch_id, "too_many_rows", f"the input file has {found.rows:,} rows; without"
                             f" SLUICEWAY_BATCH_FILES_DIR a batch's answers are kept in Redis until it ends, and the"
                             f" limit is {limit:,} rows (SLUICEWAY_BATCH_MAX_ROWS_IN_REDIS): split the file, or set"
                             " FILES_DIR")
            return
        if found.duplicates:
            await self.redis.hset(self.keys.duplicates(batch_id), mapping=found.duplicates)
        # NOTE: where the answers go is the batch's, fixed here: every later holder writes there
        answers = DIR if self.settings.files_dir else IN_REDIS
        await self.move(batch_id, IN_PROGRESS, "in_progress_at", VALIDATING, total=found.rows,
                        cursor_offset=0, cursor_line=0, answers=answers, output_bytes=0, errors_bytes=0)

    async def _fail(self, batch_id: str, code: str, message: str) -> None:
        errors = json.dumps({"object": "list", "data": [{"code": code, "message": message, "param": None,
                                                          "line": None}]})
        await self.move(batch_id, BatchStatus.FAILED.value, "failed_at", VALIDATING, errors=errors)

    async def _finalize(self, batch_id: str, meta: dict[str, str]) -> None:
        if meta.get("stop") == "expire":
            await self.lines.expire_rest(batch_id, meta)
            # NOTE: read again: the byte counts grew by the lines just answered, and the files'
            # sizes (their Content-Length, where a file in files_dir is cut) are those counts
            meta = await self.redis.hgetall(self.keys.batch(batch_id))
        fields: dict[str, Any] = {}
        tenant = meta["tenant"]
        expires_after = int(meta["output_expires_after"]) if meta.get("output_expires_after") else None
        for kind, key in self._lists(batch_id):
            file_id = output_file_id(batch_id, kind)
            size = int(meta.get(f"{'output' if kind == 'output' else 'errors'}_bytes") or 0)
            if meta.get("answers") == DIR:
                if size:  # written as the rows were answered: cut to the record, then it is a file
                    await asyncio.to_thread(truncate, self.store.path(file_id), size)
                    await self.store.record_file(tenant, file_id, f"{batch_id}_{kind}.jsonl", size, DIRECTORY,
                                                 expires_after)
                    fields[f"{kind}_file_id"] = file_id
            elif await self.redis.llen(key):
                await self.store.put_lines(tenant, file_id, f"{batch_id}_{kind}.jsonl", key, size, expires_after)
                fields[f"{kind}_file_id"] = file_id
        final = {"cancel": (BatchStatus.CANCELLED.value, "cancelled_at"), "expire": (BatchStatus.EXPIRED.value, "expired_at")
                 }.get(meta.get("stop") or "", (BatchStatus.COMPLETED.value, "completed_at"))
        await self.move(batch_id, *final, FINALIZING, CANCELLING, **fields)

    def _lists(self, batch_id: str) -> tuple[tuple[str, str], ...]:
        return ("output", self.keys.output(batch_id)), ("error", self.keys.errors(batch_id))

    async def _clean(self, batch_id: str) -> None:
        for kind, key in self._lists(batch_id):
            await self.store.drop_lines(output_file_id(batch_id, kind), key)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.pending(batch_id), self.keys.answered(batch_id), self.keys.duplicates(batch_id),
                        self.keys.lease(batch_id))
            pipe.srem(self.keys.active, batch_id)
            await pipe.execute()
        self._leased.discard(batch_id)
