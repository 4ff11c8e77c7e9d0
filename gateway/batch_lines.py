"""A batch's lines and their jobs: feeding lines to the queue, collecting their jobs' ends
and answering each line exactly once (``ANSWER_LINE_SCRIPT``). The feeder
(``gateway/batch_feeder.py``) calls these while it holds the batch's lease."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.batch_answers import Answers
from gateway.batch_input import file_lines
from gateway.batch_settings import BatchSettings
from gateway.batch_store import Store
from producers.bulk_output import json_line
from producers.jobs import cancel_call, submit_call
from producers.openai_batch import (
    MODEL_NOT_FOUND,
    Request,
    duplicate,
    failed_line,
    invalid_line,
    line_id,
    parse_request,
    unrun_line,
)
from producers.openai_format import URLS, RequestError
from producers.protocol import (
    CANCEL_SCRIPT,
    DEFAULT_CANCEL_TTL_S,
    DEFAULT_RESULT_TTL_S,
    SUBMIT_SCRIPT,
    JobField,
    JobResult,
    Status,
)
from producers.protocol.batch_scripts import ANSWER_LINE_SCRIPT, RECORD_ANSWERS_SCRIPT
from producers.scripting import register

FEED_CHUNK = 256  # lines read, submitted and then recorded in the cursor at a time
YIELD_EVERY = 16  # lines translated between two turns of the event loop (a line costs ~0.5 ms)
_FIELDS = (JobField.STATUS, JobField.RESULT, JobField.ERROR, JobField.ERROR_CODE)


def job_id_of(batch_id: str, line: int) -> str:
    return f"{batch_id}-{line}"


def line_id_of(batch_id: str, line: int) -> str:
    """The ``id`` of a line's answer: ``batch_req_`` and a hash of the line keyed by the batch's
    (secret) id, as ``sluiceway bulk --format openai`` writes it; the line's job id is its
    ``response.request_id``."""
    return line_id(batch_id.encode(), line)


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's ``output`` or ``error`` file (as secret as the batch's own id)."""
    return f"file-{batch_id.removeprefix('batch_')}-{kind}"


class BatchLines:
    """The line-level work of every batch this gateway feeds."""

    def __init__(self, store: Store, settings: BatchSettings, translate: Callable, result_body: Callable,
                 queue_of: Callable[[str | None], Awaitable[str | None]], holder: str = "") -> None:
        self.store = store
        self.holder = holder  # the lease value of this gateway (fences the record of answers)
        self.redis = store.redis
        self.keys = store.keys
        self.jobs = store.jobs
        self.settings = settings
        self.translate = translate  # (url, body, job id, tenant, deadline) -> Job; raises RequestError
        self.result_body = result_body  # JobResult -> the OpenAI response body
        self.queue_of = queue_of  # model name -> the queue its jobs go to (None: a model no worker names)
        self._submit = register(self.redis, SUBMIT_SCRIPT)
        self._cancel = register(self.redis, CANCEL_SCRIPT)
        self._answer = register(self.redis, ANSWER_LINE_SCRIPT)
        self.record_script = register(self.redis, RECORD_ANSWERS_SCRIPT)

    async def input(self, meta: dict[str, str]) -> tuple[dict[str, str], Callable]:
        file_meta = await self.redis.hgetall(self.keys.file(meta["input_file_id"]))

        async def read(offset: int, size: int) -> bytes:
            return await self.store.read_range(file_meta, offset, size)

        return file_meta, read

    async def fill(self, batch_id: str, meta: dict[str, str]) -> int:
        """Feed lines while fewer than ``max_outstanding`` jobs are in flight; the lines fed."""
        room = self.settings.max_outstanding - await self.redis.hlen(self.keys.pending(batch_id))
        file_meta, read = await self.input(meta)
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
            await self.feed(batch_id, meta, taken, offset, number)
            fed += len(taken)
            room -= len(taken)
        return fed

    async def feed(self, batch_id: str, meta: dict[str, str], taken: list, offset: int, number: int) -> None:
        """Submit the jobs of ``taken`` lines (answer the invalid ones), then move the cursor past them."""
        answered = await self.bits(batch_id, [line.number for line in taken])
        firsts = await self.redis.hmget(self.keys.duplicates(batch_id), [line.number for line in taken]) \
            if taken else []
        async with self.redis.pipeline(transaction=False) as pipe:
            answers = Answers(self, batch_id, meta, pipe)
            for i, (line, done, first) in enumerate(zip(taken, answered, firsts)):
                if done:
                    continue
                if i % YIELD_EVERY == YIELD_EVERY - 1:
                    await asyncio.sleep(0)  # NOTE: the gateway's own requests are served between lines
                request = self.request(batch_id, meta, line.number, line.raw, line.size)
                if first is not None and request.custom_id is not None:
                    request = duplicate(request, int(first))
                if request.job is None:
                    await answers.add(request.line, "", invalid_line(line_id_of(batch_id, request.line), request),
                                      "failed", "errors")
                    continue
                queue = await self.queue_of(request.model)
                if queue is None:  # NOTE: as GET /v1/models would answer it: 404 model_not_found
                    request.job, request.error_code = None, MODEL_NOT_FOUND
                    request.error = (f"line {request.line}: model {request.model!r} does not exist: no worker serves"
                                     " it (GET /v1/models lists the models served now)")
                    await answers.add(request.line, "", invalid_line(line_id_of(batch_id, request.line), request),
                                      "failed", "errors")
                    continue
                pending = json.dumps({"l": line.number, "c": request.custom_id, "q": queue,
                                      "o": line.start, "n": line.end - line.start})
                pipe.hset(self.keys.pending(batch_id), request.job.id, pending)
                await self._submit(**submit_call(self.jobs, request.job, queue), client=pipe)
            pipe.hset(self.keys.batch(batch_id), mapping={"cursor_offset": offset, "cursor_line": number})
            await answers.flush()  # NOTE: before the cursor moves past the lines it answers
            await pipe.execute()

    def request(self, batch_id: str, meta: dict[str, str], number: int, raw: bytes | None, size: int) -> Request:
        if raw is None:
            return Request(number, None, None, error=f"line {number}: the line is {size:,} bytes long; the limit is"
                                                       f" {self.settings.max_line_bytes:,} bytes")
        tenant, endpoint, deadline = meta["tenant"], meta["endpoint"], float(meta["expires_at"])

        def translate(url: Any, body: Any, job_id: str) -> Any:
            if url in URLS and url != endpoint:
                raise RequestError(f"url {url!r} is not this batch's endpoint {endpoint!r}; every line of a batch"
                                   " goes to its endpoint", "url")
            return self.translate(url, body, job_id, tenant, deadline)

        return parse_request(number, raw, job_id_of(batch_id, number), translate)

    async def bits(self, batch_id: str, numbers: list[int]) -> list[int]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for n in numbers:
                pipe.getbit(self.keys.answered(batch_id), n)
            return await pipe.execute()

    async def answer_call(self, client: Any, batch_id: str, line: int, job_id: str, text: str, counter: str,
                           kind: str) -> Any:
        target = self.keys.output(batch_id) if kind == "output" else self.keys.errors(batch_id)
        keys = [self.keys.batch(batch_id), self.keys.answered(batch_id), self.keys.pending(batch_id), target]
        return await self._answer(keys=keys, args=[line, job_id, text, counter, f"{kind}_bytes"], client=client)

    async def collect(self, batch_id: str, meta: dict[str, str]) -> int:
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
            answers = Answers(self, batch_id, meta, pipe)
            for job_id, (status, result, error, code) in zip(ids, replies):
                entry = json.loads(pending[job_id])
                if status is None:
                    lost.append(entry)
                    continue
                if status not in {s.value for s in Status} or not Status(status).terminal:
                    continue
                ended += 1
                await self.answer_job(answers, meta, job_id, entry, status, result, error, code)
                pipe.delete(self.jobs.job(job_id), self.jobs.done(job_id), self.jobs.tokens(job_id))
            await answers.flush()  # NOTE: before the jobs' keys, the answers' source, are deleted
            await pipe.execute()
        if lost:
            await self.resubmit(batch_id, meta, lost)
        return ended

    async def answer_job(self, answers: Answers, meta: dict[str, str], job_id: str, entry: dict,
                          status: str, result: str | None, error: str | None, code: str | None) -> None:
        line, custom_id = entry["l"], entry["c"]
        request_id = line_id_of(meta["id"], line)
        if status == Status.DONE.value:
            try:
                body = self.result_body(JobResult.model_validate_json(result or ""))
            except ValueError:
                status, error, code = Status.FAILED.value, "the job is done but its result is not valid", None
            else:
                text = json_line({"id": request_id, "custom_id": custom_id, "response": {
                    "status_code": 200, "request_id": job_id, "body": body}, "error": None})
                await answers.add(line, job_id, text, "completed", "output")
                return
        stop = meta.get("stop")
        if status == Status.CANCELLED.value and stop == "cancel":  # NOTE: OpenAI keeps no line of an unrun request
            await answers.add(line, job_id, "", "", "errors")
        elif status == Status.CANCELLED.value and stop == "expire" or status == Status.EXPIRED.value \
                and time.time() >= float(meta["expires_at"]):  # NOTE: its deadline is the batch's window
            text = unrun_line(request_id, custom_id, line, "batch_expired", "the batch expired before this request ran")
            await answers.add(line, job_id, text, "failed", "errors")
        else:
            await answers.add(line, job_id, failed_line(request_id, custom_id, job_id, status, error, code),
                              "failed", "errors")

    async def resubmit(self, batch_id: str, meta: dict[str, str], lost: list[dict]) -> None:
        """Jobs whose hash is gone (cut off mid-submission, or Redis lost them): submit them again."""
        _, read = await self.input(meta)
        numbers = [e["l"] for e in lost]
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry, done in zip(lost, await self.bits(batch_id, numbers)):
                job_id = job_id_of(batch_id, entry["l"])
                if done:
                    pipe.hdel(self.keys.pending(batch_id), job_id)
                    continue
                raw = (await read(entry["o"], entry["n"])).strip()
                request = self.request(batch_id, meta, entry["l"], raw, len(raw))
                if request.job is not None:
                    await self._submit(**submit_call(self.jobs, request.job, entry["q"]), client=pipe)
            await pipe.execute()

    async def cancel_pending(self, batch_id: str) -> None:
        pending = await self.redis.hgetall(self.keys.pending(batch_id))
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id, entry in pending.items():
                await self._cancel(**cancel_call(self.jobs, job_id, json.loads(entry)["q"], DEFAULT_CANCEL_TTL_S,
                                                 DEFAULT_RESULT_TTL_S), client=pipe)
            pipe.hset(self.keys.batch(batch_id), "cancel_sent", "1")
            await pipe.execute()

    async def expire_rest(self, batch_id: str, meta: dict[str, str]) -> None:
        """An error line (``batch_expired``) for every line from the cursor on, a chunk at a time."""
        file_meta, read = await self.input(meta)
        offset, number = int(meta.get("cursor_offset") or 0), int(meta.get("cursor_line") or 0)
        lines = file_lines(read, int(file_meta["bytes"]), offset, number, self.settings.max_line_bytes)
        async with self.redis.pipeline(transaction=False) as pipe:
            answers = Answers(self, batch_id, meta, pipe)
            queued = 0
            async for line in lines:
                text = unrun_line(line_id_of(batch_id, line.number), _custom_id(line.raw), line.number,
                                  "batch_expired", "the batch expired before this request ran")
                await answers.add(line.number, "", text, "failed", "errors")
                queued += 1
                if queued % FEED_CHUNK == 0:
                    await answers.flush()
                    await pipe.execute()
            await answers.flush()
            await pipe.execute()
        await self.redis.hset(self.keys.batch(batch_id), "cursor_offset", file_meta["bytes"])


def _custom_id(raw: bytes | None) -> str | None:
    """The custom_id of a line that was never parsed (for its error line), if it has one."""
    try:
        data = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):  # NOTE: RecursionError: nested past Python's own limit
        return None
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    return custom_id if isinstance(custom_id, str) else None
