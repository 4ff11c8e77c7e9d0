"""The feeder: whichever gateway holds a batch's lease validates it, feeds its lines to the
queue with at most ``max_outstanding`` jobs in flight, collects their ends and finalizes it.

The lease is a Redis key with a TTL that its holder renews on every pass; a gateway that dies
(kill -9) stops renewing and another one (every gateway scans the active set) takes the batch
over after ``lease_seconds``. Nothing is lost or done twice: a line's job id is the batch id
and the line number, so a line fed again after a takeover submits nothing new
(``SUBMIT_SCRIPT`` skips a known id); a line is answered exactly once (``ANSWER_LINE_SCRIPT``);
and the cursor (byte offset and line number of the next line to feed) is stored after each
chunk of lines, so a new holder re-reads at most one chunk.
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

from gateway.batch_input import file_lines, scan
from gateway.batch_settings import BatchSettings
from gateway.batch_store import LINES, Store
from producers.jobs import cancel_call, submit_call
from producers.openai_format import URLS, RequestError
from producers.openai_batch import Request, duplicate, failed_line, invalid_line, parse_request, unrun_line
from producers.protocol import (
    CANCEL_SCRIPT,
    DEFAULT_CANCEL_TTL_S,
    DEFAULT_RESULT_TTL_S,
    SUBMIT_SCRIPT,
    JobField,
    JobResult,
    Keys,
    Status,
)
from producers.protocol.scripts import ANSWER_LINE_SCRIPT, MOVE_BATCH_SCRIPT, RENEW_LEASE_SCRIPT

log = logging.getLogger("sluiceway.gateway.batches")
FEED_CHUNK = 256  # lines read, submitted and then recorded in the cursor at a time
YIELD_EVERY = 16  # lines translated between two turns of the event loop (a line costs ~0.5 ms)
_FIELDS = (JobField.STATUS, JobField.RESULT, JobField.ERROR, JobField.ERROR_CODE)
ENDED = frozenset({"completed", "failed", "expired", "cancelled"})


def job_id_of(batch_id: str, line: int) -> str:
    return f"{batch_id}-{line}"


class Feeder:
    """Runs every active batch this gateway holds the lease of; ``start`` / ``stop``."""

    def __init__(self, store: Store, settings: BatchSettings, translate: Callable, result_body: Callable,
                 queue_of: Callable[[str | None], Awaitable[str]]) -> None:
        self.store = store
        self.redis = store.redis
        self.keys = store.keys
        self.jobs = Keys(store.keys.prefix)
        self.settings = settings
        self.translate = translate  # (url, body, job id, tenant) -> Job; raises RequestError
        self.result_body = result_body  # JobResult -> the OpenAI response body
        self.queue_of = queue_of  # model name -> the queue its jobs go to
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._submit = self.redis.register_script(SUBMIT_SCRIPT)
        self._cancel = self.redis.register_script(CANCEL_SCRIPT)
        self._answer = self.redis.register_script(ANSWER_LINE_SCRIPT)
        self._renew = self.redis.register_script(RENEW_LEASE_SCRIPT)
        self._move = self.redis.register_script(MOVE_BATCH_SCRIPT)
        self._tasks: dict[str, asyncio.Task] = {}
        self._scanner: asyncio.Task | None = None

    async def start(self) -> None:
        self._scanner = asyncio.create_task(self._scan_loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._scanner, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for batch_id in list(self._tasks):  # hand the batches on at once rather than after the TTL
            await self.redis.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end",
                                  1, self.keys.lease(batch_id), self.holder)

    async def _scan_loop(self) -> None:
        lease_ms = int(self.settings.lease_seconds * 1000)
        while True:
            try:
                for batch_id in await self.redis.smembers(self.keys.active):
                    if batch_id in self._tasks:
                        continue
                    # NOTE: or still ours: a pass that failed (Redis away a moment) is taken up again at once
                    if await self.redis.set(self.keys.lease(batch_id), self.holder, nx=True, px=lease_ms) \
                            or await self.renew(batch_id):
                        self._tasks[batch_id] = asyncio.create_task(self._hold(batch_id))
            except asyncio.CancelledError:
                raise
            except Exception:  # NOTE: Redis away: try again next pass; the batches wait in Redis
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

    async def renew(self, batch_id: str) -> bool:
        ms = int(self.settings.lease_seconds * 1000)
        return bool(await self._renew(keys=[self.keys.lease(batch_id)], args=[self.holder, ms]))

    async def move(self, batch_id: str, status: str, time_field: str, *from_: str, **fields: Any) -> bool:
        extra = [x for kv in fields.items() for x in kv]
        args = [status, time_field, repr(time.time()), *from_, "--", *extra]
        return bool(await self._move(keys=[self.keys.batch(batch_id)], args=args))

    # -- one batch --------------------------------------------------------------------------

    async def _run(self, batch_id: str) -> None:
        while await self.renew(batch_id):
            meta = await self.redis.hgetall(self.keys.batch(batch_id))
            status = meta.get("status")
            if not meta or status in ENDED:
                await self._clean(batch_id)
                return
            if status == "validating":
                await self._validate(batch_id, meta)
                continue
            if status == "finalizing":
                await self._finalize(batch_id, meta)
                continue
            await self._collect(batch_id, meta)
            stop = meta.get("stop") or ""
            if not stop and time.time() > float(meta["expires_at"]):
                await self.redis.hset(self.keys.batch(batch_id), "stop", "expire")
                continue
            if stop:
                if meta.get("cancel_sent") != "1":
                    await self._cancel_pending(batch_id)
                if not await self.redis.hlen(self.keys.pending(batch_id)):
                    await self.move(batch_id, "finalizing", "finalizing_at", "in_progress", "cancelling")
                    continue
            else:
                fed = await self._fill(batch_id, meta)
                if not fed and not await self.redis.hlen(self.keys.pending(batch_id)):
                    await self.move(batch_id, "finalizing", "finalizing_at", "in_progress")
                    continue
            # NOTE: every pass reads the state of every job in flight, so passes are paced, not
            # spun: at most max_outstanding / poll_seconds reads a second, whatever the load.
            await asyncio.sleep(self.settings.poll_seconds)

    async def _input(self, meta: dict[str, str]) -> tuple[dict[str, str], Callable]:
        file_meta = await self.redis.hgetall(self.keys.file(meta["input_file_id"]))

        async def read(offset: int, size: int) -> bytes:
            return await self.store.read_range(file_meta, offset, size)

        return file_meta, read

    async def _validate(self, batch_id: str, meta: dict[str, str]) -> None:
        file_meta, read = await self._input(meta)
        if not file_meta or file_meta.get("storage") == LINES:
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
        if found.duplicates:
            await self.redis.hset(self.keys.duplicates(batch_id), mapping=found.duplicates)
        await self.move(batch_id, "in_progress", "in_progress_at", "validating", total=found.rows,
                        cursor_offset=0, cursor_line=0)

    async def _fail(self, batch_id: str, code: str, message: str) -> None:
        errors = json.dumps({"object": "list", "data": [{"code": code, "message": message, "param": None,
                                                          "line": None}]})
        await self.move(batch_id, "failed", "failed_at", "validating", errors=errors)

    async def _fill(self, batch_id: str, meta: dict[str, str]) -> int:
        """Feed lines while fewer than ``max_outstanding`` jobs are in flight; the lines fed."""
        room = self.settings.max_outstanding - await self.redis.hlen(self.keys.pending(batch_id))
        file_meta, read = await self._input(meta)
        size = int(file_meta["bytes"])
        offset, number = int(meta.get("cursor_offset") or 0), int(meta.get("cursor_line") or 0)
        fed = 0
        while room > 0 and offset < size:
            lines = file_lines(read, size, offset, number, self.settings.max_line_bytes)
            taken, full = [], False
            async for line in lines:
                taken.append(line)
                if len(taken) >= min(room, FEED_CHUNK):
                    full = True
                    break
            if full:
                offset, number = taken[-1].end, taken[-1].number
            else:  # the file's end: the cursor goes past it, blank lines after the last line included
                offset, number = size, taken[-1].number if taken else number
            await self._feed(batch_id, meta, taken, offset, number)
            fed += len(taken)
            room -= len(taken)
        return fed

    async def _feed(self, batch_id: str, meta: dict[str, str], taken: list, offset: int, number: int) -> None:
        """Submit the jobs of ``taken`` lines (answer the invalid ones), then move the cursor past them."""
        answered = await self._bits(batch_id, [line.number for line in taken])
        firsts = await self.redis.hmget(self.keys.duplicates(batch_id), [line.number for line in taken]) \
            if taken else []
        async with self.redis.pipeline(transaction=False) as pipe:
            for i, (line, done, first) in enumerate(zip(taken, answered, firsts)):
                if done:
                    continue
                if i % YIELD_EVERY == YIELD_EVERY - 1:
                    await asyncio.sleep(0)  # NOTE: the gateway's own requests are served between lines
                request = self._request(batch_id, meta, line.number, line.raw, line.size)
                if first is not None and request.custom_id is not None:
                    request = duplicate(request, int(first))
                if request.job is None:
                    await self._answer_call(pipe, batch_id, request.line, "", invalid_line(
                        job_id_of(batch_id, request.line), request), "failed", "errors")
                    continue
                queue = await self.queue_of(request.model)
                pending = json.dumps({"l": line.number, "c": request.custom_id, "q": queue,
                                      "o": line.start, "n": line.end - line.start})
                pipe.hset(self.keys.pending(batch_id), request.job.id, pending)
                await self._submit(**submit_call(self.jobs, request.job, queue), client=pipe)
            pipe.hset(self.keys.batch(batch_id), mapping={"cursor_offset": offset, "cursor_line": number})
            await pipe.execute()

    def _request(self, batch_id: str, meta: dict[str, str], number: int, raw: bytes | None, size: int) -> Request:
        if raw is None:
            return Request(number, None, None, error=f"line {number}: the line is {size:,} bytes long; the limit is"
                                                       f" {self.settings.max_line_bytes:,} bytes")
        tenant, endpoint = meta["tenant"], meta["endpoint"]

        def translate(url: Any, body: Any, job_id: str) -> Any:
            if url in URLS and url != endpoint:
                raise RequestError(f"url {url!r} is not this batch's endpoint {endpoint!r}; every line of a batch"
                                   " goes to its endpoint", "url")
            return self.translate(url, body, job_id, tenant)

        return parse_request(number, raw, job_id_of(batch_id, number), translate)

    async def _bits(self, batch_id: str, numbers: list[int]) -> list[int]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for n in numbers:
                pipe.getbit(self.keys.answered(batch_id), n)
            return await pipe.execute()

    async def _answer_call(self, client: Any, batch_id: str, line: int, job_id: str, text: str, counter: str,
                           kind: str) -> Any:
        target = self.keys.output(batch_id) if kind == "output" else self.keys.errors(batch_id)
        keys = [self.keys.batch(batch_id), self.keys.answered(batch_id), self.keys.pending(batch_id), target]
        return await self._answer(keys=keys, args=[line, job_id, text, counter, f"{kind}_bytes"], client=client)

    async def _collect(self, batch_id: str, meta: dict[str, str]) -> int:
        """Answer every pending line whose job has ended; the number answered."""
        pending = await self.redis.hgetall(self.keys.pending(batch_id))
        if not pending:
            return 0
        ids = list(pending)
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hmget(self.jobs.job(job_id), _FIELDS)
            replies = await pipe.execute()
        ended, lost = 0, []
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id, (status, result, error, code) in zip(ids, replies):
                entry = json.loads(pending[job_id])
                if status is None:
                    lost.append(entry)
                    continue
                if status not in {s.value for s in Status} or not Status(status).terminal:
                    continue
                ended += 1
                await self._answer_job(pipe, batch_id, meta, job_id, entry, status, result, error, code)
                pipe.delete(self.jobs.job(job_id), self.jobs.done(job_id), self.jobs.tokens(job_id))
            await pipe.execute()
        if lost:
            await self._resubmit(batch_id, meta, lost)
        return ended

    async def _answer_job(self, pipe: Any, batch_id: str, meta: dict[str, str], job_id: str, entry: dict,
                          status: str, result: str | None, error: str | None, code: str | None) -> None:
        line, custom_id = entry["l"], entry["c"]
        if status == Status.DONE.value:
            try:
                body = self.result_body(JobResult.model_validate_json(result or ""))
            except ValueError:
                status, error, code = Status.FAILED.value, "the job is done but its result is not valid", None
            else:
                text = json.dumps({"id": job_id, "custom_id": custom_id, "response": {
                    "status_code": 200, "request_id": job_id, "body": body}, "error": None}) + "\n"
                await self._answer_call(pipe, batch_id, line, job_id, text, "completed", "output")
                return
        stop = meta.get("stop")
        if status == Status.CANCELLED.value and stop == "cancel":  # NOTE: OpenAI keeps no line of an unrun request
            await self._answer_call(pipe, batch_id, line, job_id, "", "", "errors")
        elif status == Status.CANCELLED.value and stop == "expire":
            await self._answer_call(pipe, batch_id, line, job_id, unrun_line(
                job_id, custom_id, line, "batch_expired", "the batch expired before this request ran"), "failed",
                "errors")
        else:
            await self._answer_call(pipe, batch_id, line, job_id, failed_line(
                job_id, custom_id, job_id, status, error, code), "failed", "errors")

    async def _resubmit(self, batch_id: str, meta: dict[str, str], lost: list[dict]) -> None:
        """Jobs whose hash is gone (cut off mid-submission, or Redis lost them): submit them again."""
        _, read = await self._input(meta)
        numbers = [e["l"] for e in lost]
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry, done in zip(lost, await self._bits(batch_id, numbers)):
                job_id = job_id_of(batch_id, entry["l"])
                if done:
                    pipe.hdel(self.keys.pending(batch_id), job_id)
                    continue
                raw = (await read(entry["o"], entry["n"])).strip()
                request = self._request(batch_id, meta, entry["l"], raw, len(raw))
                if request.job is not None:
                    await self._submit(**submit_call(self.jobs, request.job, entry["q"]), client=pipe)
            await pipe.execute()

    async def _cancel_pending(self, batch_id: str) -> None:
        pending = await self.redis.hgetall(self.keys.pending(batch_id))
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id, entry in pending.items():
                await self._cancel(**cancel_call(self.jobs, job_id, json.loads(entry)["q"], DEFAULT_CANCEL_TTL_S,
                                                 DEFAULT_RESULT_TTL_S), client=pipe)
            pipe.hset(self.keys.batch(batch_id), "cancel_sent", "1")
            await pipe.execute()

    async def _finalize(self, batch_id: str, meta: dict[str, str]) -> None:
        if meta.get("stop") == "expire":
            await self._expire_rest(batch_id, meta)
        fields: dict[str, Any] = {}
        tenant = meta["tenant"]
        for kind, key in (("output", self.keys.output(batch_id)), ("error", self.keys.errors(batch_id))):
            if await self.redis.llen(key):
                file_id = f"file-{batch_id.removeprefix('batch_')}-{kind}"
                size = int(meta.get(f"{'output' if kind == 'output' else 'errors'}_bytes") or 0)
                await self.store.put_lines(tenant, file_id, f"{batch_id}_{kind}.jsonl", key, size)
                fields[f"{kind}_file_id"] = file_id
        final = {"cancel": ("cancelled", "cancelled_at"), "expire": ("expired", "expired_at")}.get(
            meta.get("stop") or "", ("completed", "completed_at"))
        await self.move(batch_id, *final, "finalizing", **fields)

    async def _expire_rest(self, batch_id: str, meta: dict[str, str]) -> None:
        """An error line (``batch_expired``) for every line from the cursor on, a chunk at a time."""
        file_meta, read = await self._input(meta)
        offset, number = int(meta.get("cursor_offset") or 0), int(meta.get("cursor_line") or 0)
        lines = file_lines(read, int(file_meta["bytes"]), offset, number, self.settings.max_line_bytes)
        async with self.redis.pipeline(transaction=False) as pipe:
            queued = 0
            async for line in lines:
                text = unrun_line(job_id_of(batch_id, line.number), _custom_id(line.raw), line.number,
                                  "batch_expired", "the batch expired before this request ran")
                await self._answer_call(pipe, batch_id, line.number, "", text, "failed", "errors")
                queued += 1
                if queued % FEED_CHUNK == 0:
                    await pipe.execute()
            await pipe.execute()
        await self.redis.hset(self.keys.batch(batch_id), "cursor_offset", file_meta["bytes"])

    async def _clean(self, batch_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.pending(batch_id), self.keys.answered(batch_id), self.keys.duplicates(batch_id),
                        self.keys.lease(batch_id))
            pipe.srem(self.keys.active, batch_id)
            await pipe.execute()


def _custom_id(raw: bytes | None) -> str | None:
    """The custom_id of a line that was never parsed (for its error line), if it has one."""
    try:
        data = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    return custom_id if isinstance(custom_id, str) else None
