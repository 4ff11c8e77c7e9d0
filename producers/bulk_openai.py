"""``sluiceway bulk --format openai IN OUT [--errors ERR]``: an OpenAI batch file run over the queue.

IN holds OpenAI batch request lines (``producers.openai_batch``); a line is one job per prompt
(a completions body of several prompts: several jobs). OUT gets one output line per request
whose jobs are all done (the body the endpoint answers), ERR (OUT itself when no ERR is given,
as vLLM's ``run-batch`` writes it) one line per request that is invalid or one of whose jobs
ended otherwise (the others are cancelled, as the endpoint cancels them). Lines are written as
their jobs end, in any order, each keyed by ``custom_id`` and an ``id`` derived from the line
number. Runs resume like ``sluiceway bulk``: job ids and line ids come from a secret run key
kept beside OUT (``OUT.key``), a re-run skips every line whose ``id`` is already in OUT or ERR,
and a job already submitted is not submitted again (its end is read from its hash).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from producers.bulk import WAIT_CHUNK_S, BulkSummary
from producers.bulk_input import MAX_LINE_BYTES, count_rows, input_lines, run_key
from producers.bulk_output import BulkError, check_not_input, redis_away, truncate_after_lines
from producers.client import Client
from producers.errors import RevisionNotSpoken
from producers.jobs import OUTAGE_ERRORS, Outage, block_chunk
from producers.openai_batch import (
    JobEnd,
    Request,
    Translate,
    done_line,
    duplicate,
    failed_line,
    invalid_line,
    line_end,
    line_id,
    parse_request,
    unspoken,
)
from producers.openai_format import batch_jobs, result_reads, revision_param
from producers.protocol import JobField
from producers.protocol.limits import abbreviate

_SWEEP_FIELDS = (JobField.STATUS, JobField.RESULT, JobField.ERROR, JobField.ERROR_CODE)
_LINE_START = b'{"id": "batch_req_'  # how each output and error line begins (openai_batch.line_id)


def job_id_of(key: bytes, line: int, raw: bytes) -> str:
    """A request's (first) job id: a keyed hash of its line number and bytes (a re-run derives the
    same); its other prompts' are this id and their index (``openai_format.prompt_job_id``)."""
    return "oai-" + hmac.new(key, b"%d\n" % line + raw, hashlib.sha256).hexdigest()[:32]


def answered_ids(path: Path) -> tuple[dict[str, tuple[Any, Any]], int]:
    """The ``id`` of every complete line of an existing OUT or ERR, with what it answered (its
    ``custom_id`` and its ``response.request_id``: the job id, a keyed hash of the line's bytes;
    None for a line that never ran), and how many lines are complete (a line a kill cut short
    is dropped)."""
    ids: dict[str, tuple[Any, Any]] = {}
    if not path.exists():
        return ids, 0
    count = 0
    with path.open("rb") as f:
        for number, text in enumerate(f, start=1):
            if not text.endswith(b"\n"):
                # NOTE: only a line of ours cut short by a kill is dropped: any other (a file that
                # is not a batch output) is refused before the run cuts it off
                if not (text.startswith(_LINE_START) or _LINE_START.startswith(text)):
                    raise BulkError(f"{path}:{number} is not an OpenAI batch output line cut short by a kill;"
                                    " give a new OUT path")
                break
            try:
                record = json.loads(text)
            except ValueError:
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("id"), str):
                raise BulkError(f"{path}:{number} is not an OpenAI batch output line (no \"id\")")
            response = record.get("response")
            ids[record["id"]] = (record.get("custom_id"),
                                 response.get("request_id") if isinstance(response, dict) else None)
            count += 1
    return ids, count


class OpenAIBulk:
    """One run of an OpenAI batch file: up to ``max_outstanding`` jobs in flight (each prompt of a
    line is one; a line goes whole once there is room, so one line's prompts may pass it)."""

    def __init__(self, client: Client, in_path: str | os.PathLike, out_path: str | os.PathLike,
                 err_path: str | os.PathLike | None = None, *, queue: str = "bulk", max_outstanding: int = 1000,
                 max_line_bytes: int = MAX_LINE_BYTES, timeout: float | None = None, progress: bool = False,
                 tool_parser: str | None = None) -> None:
        if max_outstanding < 1:
            raise BulkError(f"max_outstanding must be >= 1, got {max_outstanding}")
        self.client = client
        self.in_path = Path(in_path)
        self.out_path = Path(out_path)
        self.err_path = Path(err_path) if err_path is not None else None
        if self.err_path is not None and self.err_path.resolve() == self.out_path.resolve():
            self.err_path = None
        self.queue = queue
        self.max_outstanding = max_outstanding
        self.max_line_bytes = max_line_bytes
        self.timeout = timeout
        self.progress = progress
        self.summary = BulkSummary()
        # NOTE: a line's auto tool choice is read by tool_parser (--tool-call-parser), as the gateway's
        self.translate: Translate = functools.partial(batch_jobs, tool_parser=tool_parser)
        self._pending: dict[str, Request] = {}  # job id -> the request in flight it is one of the jobs of
        self._cancelled: set[str] = set()  # jobs in flight cancelled because another of their line's failed
        self._key = b""

    def run(self) -> BulkSummary:
        if not self.in_path.is_file():
            raise BulkError(f"input {self.in_path} does not exist")
        check_not_input(self.in_path, self.out_path)
        if self.err_path is not None:
            check_not_input(self.in_path, self.err_path, "ERR")
        start = time.monotonic()
        deadline = None if self.timeout is None else start + self.timeout
        key_path = self.out_path.with_name(self.out_path.name + ".key")
        done: dict[str, tuple[Any, Any]] = {}
        outs = [self.out_path] + ([self.err_path] if self.err_path else [])
        counts = []
        for path in outs:
            ids, count = answered_ids(path)
            done.update(ids)
            counts.append(count)
        try:
            self._key, made = run_key(key_path)
        except ValueError as exc:
            raise BulkError(str(exc)) from None
        except OSError as exc:
            raise BulkError(f"cannot write the run key {key_path}: {exc}") from None
        if made and done:
            raise BulkError(f"the run key {key_path} is missing, so the lines in {self.out_path} cannot be matched"
                            " with IN: restore the key or give a new OUT path")
        self._check_answered(done)
        files = [self._open(path, count) for path, count in zip(outs, counts)]
        out, err = files[0], files[-1]
        self._bar = tqdm(total=count_rows(self.in_path, self.max_line_bytes), initial=len(done), unit="row",
                         disable=not self.progress, file=sys.stderr, dynamic_ncols=True)
        try:
            self._drive(self._requests(done), out, err, deadline)
        except OUTAGE_ERRORS as exc:  # past the timeout or the outage window
            self.summary.complete = False
            raise redis_away(exc, self.timeout, deadline) from exc
        except BaseException:
            self.summary.complete = False
            raise
        finally:
            self.summary.still_running = len({r.line for r in self._pending.values()})
            self.summary.elapsed_s = time.monotonic() - start
            for f in files:
                f.close()
            self._bar.close()
        return self.summary

    def _open(self, path: Path, keep: int) -> TextIO:
        try:
            if path.exists():
                truncate_after_lines(path, keep)
            path.parent.mkdir(parents=True, exist_ok=True)
            return path.open("a", encoding="utf-8")
        except OSError as exc:  # NOTE: a read-only filesystem, no permission: the operator's to fix
            raise BulkError(f"cannot write {path}: {exc}") from None

    def _requests(self, done: dict[str, tuple[Any, Any]]):
        """Each line of IN not answered yet, as a ``Request`` (duplicates of a custom_id made errors);
        a ``BulkError`` where an answered line no longer holds what it answered (IN was edited)."""
        first_line: dict[str, int] = {}
        for line, raw in input_lines(self.in_path, self.max_line_bytes):
            self.summary.rows += 1
            if isinstance(raw, int):
                request = Request(line, None, None, error=f"line {line}: the line is {raw:,} bytes long; the"
                                                          f" limit is {self.max_line_bytes:,} bytes")
            else:
                request = parse_request(line, raw, job_id_of(self._key, line, raw), self.translate)
            if request.custom_id is not None:
                first = first_line.setdefault(request.custom_id, line)
                if first != line:
                    request = duplicate(request, first)
            if line_id(self._key, line) in done:
                self.summary.kept += 1
                continue
            yield request

    def _check_answered(self, done: dict[str, tuple[Any, Any]]) -> None:
        """Refuse, before anything is submitted or written, an IN whose answered lines changed
        since OUT answered them (an edited input re-run into the same OUT)."""
        if not done:
            return
        for line, raw in input_lines(self.in_path, self.max_line_bytes):
            answered = done.get(line_id(self._key, line))
            if answered is None:
                continue
            custom_id, job_id = answered
            if job_id is not None:  # it ran: its job id is a keyed hash of the line's bytes
                same = isinstance(raw, bytes) and job_id == job_id_of(self._key, line, raw)
            else:  # an error line of a line that could not run: its custom_id, as parsed then
                same = not isinstance(raw, bytes) or custom_id == parse_request(
                    line, raw, job_id_of(self._key, line, raw)).custom_id
            if not same:
                raise BulkError(f"{self.in_path} line {line} is not the line {self.out_path} answered (custom_id"
                                f" {abbreviate(custom_id)} then): OUT was written for another input; give a new OUT"
                                " path")

    def _drive(self, requests, out: TextIO, err: TextIO, deadline: float | None) -> None:
        exhausted = False
        # NOTE: the timeout bounds a wait for Redis too; the client's own rides inside (submit_many's)
        # count on this ride's clock and stop at its deadline, so an outage is ridden for one window
        with Outage(deadline=deadline) as outage:
            while True:
                try:
                    exhausted = exhausted or self._fill(requests, err)
                    if exhausted and not self._pending:
                        return
                    if deadline is not None and time.monotonic() >= deadline:
                        self.summary.complete = False
                        return
                    if not self._sweep(out, err) and self._pending:
                        self._wait(deadline)
                except OUTAGE_ERRORS as exc:
                    time.sleep(outage.failed(exc))
                    if deadline is not None and time.monotonic() >= deadline:
                        raise  # NOTE: Redis still away when the timeout ran out: its error, as Client.result raises it
                    continue
                outage.ok()

    def _fill(self, requests, err: TextIO) -> bool:
        batch, jobs, exhausted = [], 0, False
        while len(self._pending) + jobs < self.max_outstanding:
            request = next(requests, None)
            if request is None:
                exhausted = True
                break
            if request.jobs:
                self._check_revision(request)
            if not request.jobs:
                self.summary.invalid += 1
                err.write(invalid_line(line_id(self._key, request.line), request))
                err.flush()
                self._bar.update(1)
            else:
                batch.append(request)
                jobs += len(request.jobs)
        if batch:
            self._pending.update((job.id, r) for r in batch for job in r.jobs)  # NOTE: first, as in Bulk._submit
            self.client.submit_many([job for r in batch for job in r.jobs], queue=self.queue)
        return exhausted

    def _check_revision(self, request: Request) -> None:
        """A line whose jobs need a later protocol revision than the queue's live workers speak (an
        echo to workers of 1.3) made an error line, as the endpoint answers it (400
        ``unsupported_protocol_revision``), rather than jobs they refuse."""
        for job in request.jobs:
            try:
                self.client.check_revision(job, self.queue, reads=result_reads(job))
            except RevisionNotSpoken as exc:
                unspoken(request, revision_param(exc.field), exc.reason)
                return

    def _sweep(self, out: TextIO, err: TextIO) -> bool:
        ids = list(self._pending)
        with self.client.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hmget(self.client.keys.job(job_id), _SWEEP_FIELDS)
            ends = {job_id: JobEnd(*reply) for job_id, reply in zip(ids, pipe.execute())}
        lost, ended = [], False
        for request in {r.line: r for r in self._pending.values()}.values():  # each line in flight once
            line_ends = [ends[job.id] for job in request.jobs]
            if any(end.status is None for end in line_ends):  # e.g. Redis restarted without persistence
                lost += [job for job, end in zip(request.jobs, line_ends) if end.status is None]
                continue
            running = [job.id for job, end in zip(request.jobs, line_ends) if not end.ended]
            if running:
                if any(end.failed for end in line_ends):
                    for job_id in set(running) - self._cancelled:  # NOTE: the line has failed: as the endpoint does
                        self.client.cancel(job_id)
                        self._cancelled.add(job_id)
                continue
            ended = True
            for job in request.jobs:
                del self._pending[job.id]
                self._cancelled.discard(job.id)
            self._answer(request, line_ends, out, err)
        if lost:
            self.client.submit_many(lost, queue=self.queue)
        return ended

    def _answer(self, request: Request, ends: list[JobEnd], out: TextIO, err: TextIO) -> None:
        request_id = line_id(self._key, request.line)
        self._bar.update(1)
        end = line_end(ends)
        if end.results is not None:
            self.summary.done += 1
            self.summary.prompt_tokens += sum(r.usage.prompt_tokens for r in end.results)
            self.summary.completion_tokens += sum(r.usage.completion_tokens for r in end.results)
            out.write(done_line(request_id, request.custom_id, request.url, request.model, request.jobs[0].id,
                                end.results))
            out.flush()
            return
        self.summary.failed += 1
        err.write(failed_line(request_id, request.custom_id, request.jobs[0].id, end.status, end.error, end.code))
        err.flush()

    def _wait(self, deadline: float | None) -> None:
        left = None if deadline is None else max(0.01, deadline - time.monotonic())
        head = next(iter(self._pending))
        done_key = self.client.keys.done(head)
        chunk = block_chunk(left, self.client.socket_timeout, cap=WAIT_CHUNK_S)
        self.client.redis.blmove(done_key, done_key, chunk, "RIGHT", "LEFT")
