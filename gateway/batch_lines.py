"""A batch's lines and their jobs: feeding lines to the queue, collecting their jobs' ends
and answering each line exactly once (``ANSWER_LINE_SCRIPT``). The feeder
(``gateway/batch_feeder.py``) calls these while it holds the batch's lease.

A line is one job per prompt, as the endpoint makes them (a completions body of several
prompts: several jobs, ``job_ids_of``); each job has its own entry in the pending hash, and the
line is answered once all of its jobs have ended, by the one answer the endpoint gives."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.batch_answers import Answers
from gateway.batch_input import Line, file_lines
from gateway.batch_settings import BatchSettings
from gateway.batch_store import Store
from producers.bulk_output import json_line
from producers.jobs import cancel_call, submit_call
from producers.openai_batch import (
    MODEL_NOT_FOUND,
    JobEnd,
    LineEnd,
    Request,
    duplicate,
    failed_line,
    invalid_line,
    line_end,
    line_id,
    parse_request,
    unrun_line,
    unspoken,
)
from producers.openai_errors import RequestError
from producers.openai_format import URLS, prompt_job_id
from producers.protocol import (
    CANCEL_SCRIPT,
    DEFAULT_CANCEL_TTL_S,
    DEFAULT_RESULT_TTL_S,
    SUBMIT_SCRIPT,
    Job,
    JobField,
    Status,
)
from producers.protocol.batch_scripts import ANSWER_LINE_SCRIPT, RECORD_ANSWERS_SCRIPT
from producers.scripting import register

FEED_CHUNK = 256  # lines read, submitted and then recorded in the cursor at a time
YIELD_EVERY = 16  # jobs (or lines without one) translated between two turns of the event loop (~0.5 ms each)
_FIELDS = (JobField.STATUS, JobField.RESULT, JobField.ERROR, JobField.ERROR_CODE)  # JobEnd's order
# (model name, its queue, a line's jobs) -> the body's field and why, when a live worker of the queue cannot read them
Unspoken = Callable[[str | None, str, list[Job]], Awaitable[tuple[str, str] | None]]


def job_id_of(batch_id: str, line: int) -> str:
    """The id of a line's (first) job: the line's ``response.request_id``."""
    return f"{batch_id}-{line}"


def job_ids_of(batch_id: str, line: int, prompts: int = 1) -> list[str]:
    """The ids of a line's jobs, one per prompt: ``{batch id}-{line}``, then ``-1``, ``-2``, ... appended."""
    return [prompt_job_id(job_id_of(batch_id, line), i) for i in range(prompts)]


def line_id_of(batch_id: str, line: int) -> str:
    """The ``id`` of a line's answer: ``batch_req_`` and a hash of the line keyed by the batch's
    (secret) id, as ``sluiceway bulk --format openai`` writes it; the line's job id is its
    ``response.request_id``."""
    return line_id(batch_id.encode(), line)


class BatchLines:
    """The line-level work of every batch this gateway feeds."""

    def __init__(self, store: Store, settings: BatchSettings, translate: Callable, result_body: Callable,
                 queue_of: Callable[[str | None], Awaitable[str | None]], unspoken_of: Unspoken,
                 holder: str = "") -> None:
        self.store = store
        self.holder = holder  # the lease value of this gateway (fences the record of answers)
        self.redis = store.redis
        self.keys = store.keys
        self.jobs = store.jobs
        self.settings = settings
        self.translate = translate  # (url, body, job id, tenant, deadline) -> the line's jobs; raises RequestError
        self.result_body = result_body  # the JobResults of a line's jobs -> the OpenAI response body
        self.queue_of = queue_of  # model name -> the queue its jobs go to (None: a model no worker names)
        self.unspoken_of = unspoken_of  # (model name, queue, a line's jobs) -> the field and why they cannot be read
        self._submit = register(self.redis, SUBMIT_SCRIPT)
        self._cancel = register(self.redis, CANCEL_SCRIPT)
        self._answer = register(self.redis, ANSWER_LINE_SCRIPT)
        self.record_script = register(self.redis, RECORD_ANSWERS_SCRIPT)
        # batch id -> its pending lines whose failed prompt's other jobs this gateway has cancelled
        self._cancelled: dict[str, set[int]] = {}

    async def input(self, meta: dict[str, str]) -> tuple[dict[str, str], Callable]:
        file_meta = await self.redis.hgetall(self.keys.file(meta["input_file_id"]))

        async def read(offset: int, size: int) -> bytes:
            return await self.store.read_range(file_meta, offset, size)

        return file_meta, read

    async def fill(self, batch_id: str, meta: dict[str, str]) -> int:
        """Feed lines while fewer than ``max_outstanding`` jobs are in flight; the lines fed.

        NOTE: each prompt of a line is a job in flight (a line of 256 prompts counts 256), and a
        line goes whole once there is room, so the jobs in flight pass ``max_outstanding`` by at
        most one line's prompts less one (``MAX_PROMPTS`` - 1)."""
        room = self.settings.max_outstanding - await self.redis.hlen(self.keys.pending(batch_id))
        file_meta, read = await self.input(meta)
        size = int(file_meta["bytes"])
        offset, number = int(meta.get("cursor_offset") or 0), int(meta.get("cursor_line") or 0)
        fed = translated = 0
        while room > 0 and offset < size:
            lines = file_lines(read, size, offset, number, self.settings.max_line_bytes)
            taken: list[tuple[Line, Request]] = []
            jobs, full = 0, False
            async for line in lines:
                request = self.request(batch_id, meta, line.number, line.raw, line.size)
                taken.append((line, request))
                jobs += max(1, len(request.jobs))  # NOTE: a line without jobs (invalid) counts one, as before
                translated += max(1, len(request.jobs))
                if translated >= YIELD_EVERY:
                    translated = 0
                    await asyncio.sleep(0)  # NOTE: the gateway's own requests are served between lines
                if jobs >= room or len(taken) >= FEED_CHUNK:
                    full = True
                    break
            if full:
                offset, number = taken[-1][0].end, taken[-1][0].number
            else:  # the file's end: the cursor goes past it, blank lines after the last line included
                offset, number = size, taken[-1][0].number if taken else number
            await self.feed(batch_id, meta, taken, offset, number)
            fed += len(taken)
            room -= jobs
        return fed

    async def feed(self, batch_id: str, meta: dict[str, str], taken: list[tuple[Line, Request]], offset: int,
                   number: int) -> None:
        """Submit the jobs of ``taken`` lines (answer the invalid ones), then move the cursor past them."""
        numbers = [line.number for line, _ in taken]
        answered = await self.bits(batch_id, numbers)
        firsts = await self.redis.hmget(self.keys.duplicates(batch_id), numbers) if taken else []
        async with self.redis.pipeline(transaction=False) as pipe:
            answers = Answers(self, batch_id, meta, pipe)
            for (line, request), done, first in zip(taken, answered, firsts):
                if done:
                    continue
                if first is not None and request.custom_id is not None:
                    request = duplicate(request, int(first))
                if not request.jobs:
                    await answers.add(request.line, [], invalid_line(line_id_of(batch_id, request.line), request),
                                      "failed", "errors")
                    continue
                queue = await self.queue_of(request.model)
                if queue is None:  # NOTE: as GET /v1/models would answer it: 404 model_not_found
                    request.jobs, request.error_code = [], MODEL_NOT_FOUND
                    request.error = (f"line {request.line}: model {request.model!r} does not exist: no worker serves"
                                     " it (GET /v1/models lists the models served now)")
                    await answers.add(request.line, [], invalid_line(line_id_of(batch_id, request.line), request),
                                      "failed", "errors")
                    continue
                found = await self.unspoken_of(request.model, queue, request.jobs)
                if found is not None:  # NOTE: as the endpoint answers it: 400 unsupported_protocol_revision
                    await answers.add(request.line, [], invalid_line(line_id_of(batch_id, request.line),
                                                                     unspoken(request, *found)), "failed", "errors")
                    continue
                entry = {"l": line.number, "c": request.custom_id, "q": queue, "o": line.start,
                         "n": line.end - line.start}
                if len(request.jobs) > 1:
                    entry["k"] = len(request.jobs)  # NOTE: absent: one job, as every line had before
                await self.submit(pipe, batch_id, entry, request)
            pipe.hset(self.keys.batch(batch_id), mapping={"cursor_offset": offset, "cursor_line": number})
            await answers.flush()  # NOTE: before the cursor moves past the lines it answers
            await pipe.execute()

    async def submit(self, pipe: Any, batch_id: str, entry: dict, request: Request) -> None:
        """Queue on ``pipe`` the pending entries of a line's jobs, then the jobs (the submit script
        skips an id Redis already knows: a line fed again submits nothing new)."""
        text = json.dumps(entry)
        pipe.hset(self.keys.pending(batch_id), mapping={job.id: text for job in request.jobs})
        for job in request.jobs:
            await self._submit(**submit_call(self.jobs, job, entry["q"]), client=pipe)

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

    async def answer_call(self, client: Any, batch_id: str, line: int, job_ids: list[str], text: str, counter: str,
                          kind: str) -> Any:
        target = self.keys.output(batch_id) if kind == "output" else self.keys.errors(batch_id)
        keys = [self.keys.batch(batch_id), self.keys.answered(batch_id), self.keys.pending(batch_id), target]
        args = [line, " ".join(job_ids), text, counter, f"{kind}_bytes"]
        return await self._answer(keys=keys, args=args, client=client)

    async def collect(self, batch_id: str, meta: dict[str, str]) -> int:
        """Answer every pending line whose jobs have all ended; the number answered. The jobs still
        running of a line one of whose jobs failed are cancelled, as the endpoint cancels a request's."""
        pending = await self.redis.hgetall(self.keys.pending(batch_id))
        if not pending:
            self.forget(batch_id)
            return 0
        entries: dict[int, dict] = {}
        for text in pending.values():
            entry = json.loads(text)
            entries.setdefault(entry["l"], entry)
        # NOTE: a line is remembered while it is pending: its cancel is sent once, not each pass until
        # its jobs end (a holder that takes the batch over sends it once more, which the script allows)
        cancelled = self._cancelled.setdefault(batch_id, set())
        cancelled.intersection_update(entries)
        # NOTE: every job of a line, whether its entry is pending or not: a line is answered for all of them
        ids = {number: job_ids_of(batch_id, number, entry.get("k", 1)) for number, entry in entries.items()}
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_ids in ids.values():
                for job_id in job_ids:
                    pipe.hmget(self.jobs.job(job_id), _FIELDS)
            replies = iter(await pipe.execute())
        ended, lost, doomed, doomed_lines = 0, [], [], []
        async with self.redis.pipeline(transaction=False) as pipe:
            answers = Answers(self, batch_id, meta, pipe)
            for number, entry in entries.items():
                ends = [JobEnd(*next(replies)) for _ in ids[number]]
                if any(end.status is None for end in ends):
                    lost.append(entry)
                    continue
                running = [job_id for job_id, end in zip(ids[number], ends) if not end.ended]
                if running:
                    # NOTE: the line has failed: as the endpoint does
                    if any(end.failed for end in ends) and number not in cancelled:
                        doomed += [(job_id, entry["q"]) for job_id in running]
                        doomed_lines.append(number)
                    continue
                ended += 1
                cancelled.discard(number)
                await self.answer_line(answers, meta, entry, ids[number], ends)
                for job_id in ids[number]:
                    pipe.delete(self.jobs.job(job_id), self.jobs.done(job_id), self.jobs.tokens(job_id))
            await answers.flush()  # NOTE: before the jobs' keys, the answers' source, are deleted
            await pipe.execute()
        if doomed:
            await self.cancel(doomed)
            cancelled.update(doomed_lines)
        if lost:
            await self.resubmit(batch_id, meta, lost)
        return ended

    async def answer_line(self, answers: Answers, meta: dict[str, str], entry: dict, job_ids: list[str],
                          ends: list[JobEnd]) -> None:
        """Answer a line whose jobs (``job_ids``, ended as ``ends``) have all ended."""
        line, custom_id = entry["l"], entry["c"]
        request_id = line_id_of(meta["id"], line)
        end = line_end(ends)
        if end.results is not None:
            try:
                body = self.result_body(end.results)
            except ValueError:
                end = LineEnd(Status.FAILED.value, error="the job is done but its result is not valid")
            else:
                text = json_line({"id": request_id, "custom_id": custom_id, "response": {
                    "status_code": 200, "request_id": job_ids[0], "body": body}, "error": None})
                await answers.add(line, job_ids, text, "completed", "output")
                return
        stop = meta.get("stop")
        if end.status == Status.CANCELLED.value and stop == "cancel":  # NOTE: OpenAI keeps no line of an unrun request
            await answers.add(line, job_ids, "", "", "errors")
        elif end.status == Status.CANCELLED.value and stop == "expire" or end.status == Status.EXPIRED.value \
                and time.time() >= float(meta["expires_at"]):  # NOTE: its deadline is the batch's window
            text = unrun_line(request_id, custom_id, line, "batch_expired", "the batch expired before this request ran")
            await answers.add(line, job_ids, text, "failed", "errors")
        else:
            text = failed_line(request_id, custom_id, job_ids[0], end.status, end.error, end.code)
            await answers.add(line, job_ids, text, "failed", "errors")

    async def resubmit(self, batch_id: str, meta: dict[str, str], lost: list[dict]) -> None:
        """Lines with a job whose hash is gone (cut off mid-submission, or Redis lost it): their jobs
        submitted again from the line's bytes (the submit script skips the ids Redis still has)."""
        _, read = await self.input(meta)
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry, done in zip(lost, await self.bits(batch_id, [e["l"] for e in lost])):
                if done:
                    pipe.hdel(self.keys.pending(batch_id), *job_ids_of(batch_id, entry["l"], entry.get("k", 1)))
                    continue
                raw = (await read(entry["o"], entry["n"])).strip()
                request = self.request(batch_id, meta, entry["l"], raw, len(raw))
                if request.jobs:
                    await self.submit(pipe, batch_id, entry, request)
            await pipe.execute()

    def forget(self, batch_id: str) -> None:
        """Drop what this gateway remembers of a batch's lines (it ended, or another holds it now)."""
        self._cancelled.pop(batch_id, None)

    async def cancel_pending(self, batch_id: str) -> None:
        pending = await self.redis.hgetall(self.keys.pending(batch_id))
        await self.cancel([(job_id, json.loads(entry)["q"]) for job_id, entry in pending.items()],
                          self.keys.batch(batch_id))

    async def cancel(self, jobs: list[tuple[str, str]], batch_key: str | None = None) -> None:
        """Cancel the jobs (id, queue); with ``batch_key``, record in the batch that its cancel was sent."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id, queue in jobs:
                await self._cancel(**cancel_call(self.jobs, job_id, queue, DEFAULT_CANCEL_TTL_S, DEFAULT_RESULT_TTL_S),
                                   client=pipe)
            if batch_key is not None:
                pipe.hset(batch_key, "cancel_sent", "1")
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
                await answers.add(line.number, [], text, "failed", "errors")
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
