"""The bulk JSONL pipeline behind ``sluiceway bulk IN.jsonl OUT.jsonl``.

Each non-blank input line is a job object (protocol v1 fields, ``id`` optional). OUT gets
one line per input row, in input order, whatever order the jobs finish in. Runs resume:
a row without an ``id`` gets one derived from its line number and content, so a re-run
submits the same ids; submitting an id Redis already knows enqueues nothing, and the
row's result is read from its job hash instead. Rows already in OUT are not touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError
from tqdm import tqdm

from producers.client import Client
from producers.jobs import OUTAGE_ERRORS, Outage, block_chunk
from producers.protocol import (
    MAX_ID_LENGTH,
    Job,
    JobField,
    JobResult,
    Status,
    describe_validation_error,
)

INVALID = "invalid"  # the status of an output row whose input line is not a valid job
REPORT_LIMIT = 20  # per kind of problem, lines reported one by one before a count
READY_PER_OUTSTANDING = 10  # finished rows held for in-order writing, per outstanding slot
_SWEEP_FIELDS = (JobField.STATUS, JobField.RESULT, JobField.ERROR)


class BulkError(Exception):
    """The run cannot start or go on (e.g. OUT belongs to another input)."""


@dataclass
class Row:
    """One non-blank input line and what becomes of it."""

    seq: int  # position among the input's rows (= line in OUT)
    line: int  # 1-based line number in IN
    base_id: str | None  # the id of its first attempt (None: the line is not a job)
    job: Job | None = None
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    attempt: int = 0
    retried: bool = False  # retried once already in this run
    prior: dict[str, Any] | None = None  # its row in OUT, when that row stays as it is

    @property
    def job_id(self) -> str | None:
        return None if self.base_id is None else attempt_id(self.base_id, self.attempt)


@dataclass
class BulkSummary:
    rows: int = 0
    kept: int = 0  # already in OUT, left as they were
    done: int = 0
    failed: int = 0  # failed, cancelled or expired
    invalid: int = 0
    retried: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    complete: bool = True  # False: stopped early (timeout, interrupt); re-run to finish
    still_running: int = 0

    def line(self) -> str:
        rate = (self.done + self.failed) / self.elapsed_s if self.elapsed_s else 0.0
        tok_rate = self.completion_tokens / self.elapsed_s if self.elapsed_s else 0.0
        text = (
            f"{self.rows} rows: {self.done} done, {self.failed} failed, {self.invalid} invalid,"
            f" {self.kept} already in OUT; {self.retried} retried; tokens {self.prompt_tokens} in /"
            f" {self.completion_tokens} out; {self.elapsed_s:.1f}s, {rate:.1f} rows/s, {tok_rate:.0f} tok/s"
        )
        if not self.complete:
            text += f"; stopped early with {self.still_running} rows unfinished: run again to resume"
        return text


def derived_id(line: int, text: str) -> str:
    """The id of a row that names none: stable for the same line number and content."""
    return "bulk-" + hashlib.sha256(f"{line}\n{text}".encode()).hexdigest()[:32]


def attempt_id(base_id: str, attempt: int) -> str:
    """The id of a row's ``attempt``-th retry (0 is the row's own id)."""
    if attempt == 0:
        return base_id
    retry = f"{base_id}.r{attempt}"
    if len(retry) <= MAX_ID_LENGTH:
        return retry
    return "bulk-" + hashlib.sha256(retry.encode()).hexdigest()[:32]


def parse_row(seq: int, line: int, text: str, *, job_deadline_s: float | None = None) -> Row:
    """One input line as a row; an invalid line becomes a row with ``error`` naming the field."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        return Row(seq, line, None, error=f"line {line}: not valid JSON: {exc}")
    if not isinstance(data, dict):
        return Row(seq, line, None, error=f"line {line}: a job must be a JSON object, got {type(data).__name__}")
    metadata = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    data.setdefault("id", derived_id(line, text))
    if job_deadline_s is not None and data.get("deadline") is None:
        data["deadline"] = time.time() + job_deadline_s
    try:
        job = Job.model_validate(data)
    except ValidationError as exc:
        return Row(seq, line, None, error=f"line {line}: {describe_validation_error(exc)}", metadata=metadata)
    return Row(seq, line, job.id, job=job, metadata=metadata)


def read_rows(path: Path, job_deadline_s: float | None = None) -> Iterator[Row]:
    with path.open(encoding="utf-8") as f:
        seq = 0
        for line, text in enumerate(f, start=1):
            text = text.strip()
            if text:
                yield parse_row(seq, line, text, job_deadline_s=job_deadline_s)
                seq += 1


def count_rows(path: Path) -> int:
    with path.open(encoding="utf-8") as f:
        return sum(1 for text in f if text.strip())


def read_out(path: Path) -> Iterator[dict[str, Any]]:
    """The complete rows of an existing OUT; a line cut short by a kill is left out."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.endswith("\n"):
                return  # the write a kill interrupted
            try:
                yield json.loads(text)
            except ValueError:
                raise BulkError(f"{path}:{number} is not a JSON line: OUT is not a bulk output file") from None


def _ended_well(record: dict[str, Any]) -> bool:
    return record.get("status") in (Status.DONE.value, INVALID)


# NOTE: characters JSON leaves raw but str.splitlines() (and JavaScript before ES2019) treat as
# line ends; escaped, every OUT line splits the same way in any reader.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def json_line(record: dict[str, Any]) -> str:
    """One OUT line: UTF-8 JSON (non-ASCII text stays readable), no line break but its own."""
    return json.dumps(record, ensure_ascii=False).translate(_LINE_BREAKS) + "\n"


def output_line(row: Row, status: str, result: JobResult | None = None, error: str | None = None) -> str:
    record = {
        "line": row.line,
        "id": row.job_id,
        "status": status,
        "text": result.text if result else None,
        "error": error,
        "attempt": row.attempt,
        "metadata": row.metadata,
        "result": result.model_dump(mode="json") if result else None,
    }
    return json_line(record)


class Bulk:
    """One run: plan rows against OUT, keep up to ``max_outstanding`` jobs in flight, write in order."""

    def __init__(
        self,
        client: Client,
        in_path: str | os.PathLike,
        out_path: str | os.PathLike,
        *,
        queue: str = "bulk",
        max_outstanding: int = 1000,
        retry_failed: bool = False,
        timeout: float | None = None,
        job_deadline_s: float | None = None,
        progress: bool = True,
        report: Callable[[str], None] | None = None,
    ) -> None:
        if max_outstanding < 1:
            raise BulkError(f"max_outstanding must be >= 1, got {max_outstanding}")
        self.client = client
        self.in_path = Path(in_path)
        self.out_path = Path(out_path)
        self.queue = queue
        self.max_outstanding = max_outstanding
        self.retry_failed = retry_failed
        self.timeout = timeout
        self.job_deadline_s = job_deadline_s
        self.progress = progress
        self._report = report or (lambda text: tqdm.write(text, file=sys.stderr))
        self._reported: dict[str, int] = {}
        self.summary = BulkSummary()
        self._pending: dict[str, Row] = {}  # job id -> row in flight
        self._ready: dict[int, tuple[str, bool]] = {}  # seq -> (output line, new) waiting for earlier rows
        self._next_write = 0
        self._rewrite = False  # OUT is written anew (retried rows in it) rather than appended to

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> BulkSummary:
        if not self.in_path.is_file():
            raise BulkError(f"input {self.in_path} does not exist")
        start = time.monotonic()
        deadline = None if self.timeout is None else start + self.timeout
        self.summary.rows = count_rows(self.in_path)
        written = redo = 0
        for record in read_out(self.out_path):
            written += 1
            redo += not _ended_well(record)
        if written > self.summary.rows:
            raise BulkError(f"{self.out_path} has {written} rows but {self.in_path} only {self.summary.rows}")
        rewrite = self._rewrite = self.retry_failed and redo > 0
        tmp = self.out_path.with_name(self.out_path.name + ".tmp")
        out = self._open_out(tmp if rewrite else self.out_path, append=not rewrite, keep=written)
        bar = tqdm(
            total=self.summary.rows, initial=written - (redo if rewrite else 0), unit="row",
            disable=not self.progress, file=sys.stderr, dynamic_ncols=True,
        )
        try:
            rows = self._plan(read_rows(self.in_path, self.job_deadline_s), read_out(self.out_path), rewrite)
            self._drive(rows, out, bar, deadline)
        except KeyboardInterrupt:
            self.summary.complete = False
            self._write_ready(out, bar)
            raise
        finally:
            self.summary.still_running = len(self._pending)
            self.summary.elapsed_s = time.monotonic() - start
            out.close()
            bar.close()
            if rewrite and self.summary.complete:
                os.replace(tmp, self.out_path)
        return self.summary

    def _open_out(self, path: Path, *, append: bool, keep: int) -> TextIO:
        if append and path.exists():
            _truncate_after_lines(path, keep)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("a" if append else "w", encoding="utf-8")

    def _plan(self, rows: Iterator[Row], old: Iterator[dict[str, Any]], rewrite: bool) -> Iterator[Row]:
        """IN's rows, each matched with its OUT row if it has one (``prior``); a row to be
        retried comes out with its next attempt's id."""
        for row in rows:
            prior = next(old, None)
            if prior is None:
                yield row
                continue
            row.attempt = int(prior.get("attempt") or 0)
            if prior.get("line") != row.line or prior.get("id") != row.job_id:
                raise BulkError(
                    f"{self.out_path} row {row.seq + 1} is line {prior.get('line')} id {prior.get('id')}, but"
                    f" {self.in_path} row {row.seq + 1} is line {row.line} id {row.job_id}: OUT was written for"
                    " another input; give a new OUT path"
                )
            if rewrite and not _ended_well(prior):
                self._retry(row)
            else:
                row.prior = prior
                self.summary.kept += 1
            yield row

    def _drive(self, rows: Iterator[Row], out: TextIO, bar: tqdm, deadline: float | None) -> None:
        rows = iter(rows)
        exhausted = False
        outage = Outage()
        while True:
            try:
                exhausted = exhausted or self._fill(rows)
                self._write_ready(out, bar)
                if exhausted and not self._pending:
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    self.summary.complete = False
                    return
                if not self._sweep() and self._pending:
                    self._wait(deadline)
            except OUTAGE_ERRORS as exc:
                time.sleep(outage.failed(exc))  # rows in flight are found again by the next sweep
                continue
            outage.ok()

    def _fill(self, rows: Iterator[Row]) -> bool:
        """Submit rows while there is room; True once the input is used up."""
        batch: list[Row] = []
        ready_limit = READY_PER_OUTSTANDING * self.max_outstanding
        while len(self._pending) + len(batch) < self.max_outstanding and len(self._ready) < ready_limit:
            row = next(rows, None)
            if row is None:
                self._submit(batch)
                return True
            if row.prior is not None:
                self._keep(row)
            elif row.job is None:
                self._end_invalid(row)
            else:
                batch.append(row)
        self._submit(batch)
        return False

    def _submit(self, batch: list[Row]) -> None:
        if batch:
            # NOTE: pending first: if the submission is cut off, the sweep finds no job hash for
            # these ids and submits them again. Ids Redis already knows (a resumed run) are not
            # enqueued again; the sweep finds their end in the job hash.
            self._pending.update((row.job_id, row) for row in batch)
            self.client.submit_many([row.job for row in batch], queue=self.queue)

    def _sweep(self) -> bool:
        """Collect every pending job that has ended; True if any had."""
        ids = list(self._pending)
        with self.client.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hmget(self.client.keys.job(job_id), _SWEEP_FIELDS)
            replies = pipe.execute()
        lost: list[Row] = []
        ended = False
        for job_id, (status, result, error) in zip(ids, replies):
            if status is None:
                lost.append(self._pending.pop(job_id))  # e.g. Redis restarted without persistence
            elif Status(status).terminal:
                ended = True
                self._end(self._pending.pop(job_id), Status(status), result, error)
        self._submit(lost)
        return ended

    def _wait(self, deadline: float | None) -> None:
        """Block until some pending job signals its end (or a chunk of time passes)."""
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        keys = [self.client.keys.done(job_id) for job_id in self._pending]
        woke = self.client.redis.blpop(keys, timeout=block_chunk(left, self.client.socket_timeout, cap=1.0))
        if woke is not None:
            key, value = woke
            self.client.redis.rpush(key, value)  # put the signal back for other waiters

    # -- ends of rows -----------------------------------------------------------------------

    def _end(self, row: Row, status: Status, result: str | None, error: str | None) -> None:
        if status is Status.DONE and result is None:
            status, error = Status.FAILED, "the job is done but its hash holds no result"
        if status is Status.DONE:
            parsed = JobResult.model_validate_json(result)
            self.summary.done += 1
            self.summary.prompt_tokens += parsed.usage.prompt_tokens
            self.summary.completion_tokens += parsed.usage.completion_tokens
            self._ready[row.seq] = (output_line(row, status.value, result=parsed), True)
            return
        reason = error or status.value
        if self.retry_failed and not row.retried:
            self._report_row("retry", f"line {row.line}: job {row.job_id} {status.value} ({reason}); retrying")
            self._retry(row)
            self._submit([row])
            return
        self.summary.failed += 1
        self._report_row("failed", f"line {row.line}: job {row.job_id} {status.value}: {reason}")
        self._ready[row.seq] = (output_line(row, status.value, error=reason), True)

    def _keep(self, row: Row) -> None:
        if self._rewrite:
            self._ready[row.seq] = (json_line(row.prior), False)
        else:
            self._next_write = row.seq + 1  # it stays where it is in OUT

    def _end_invalid(self, row: Row) -> None:
        self.summary.invalid += 1
        self._report_row(INVALID, f"{row.error} (written as {INVALID})")
        self._ready[row.seq] = (output_line(row, INVALID, error=row.error), True)

    def _retry(self, row: Row) -> None:
        row.attempt += 1
        row.retried = True
        row.job = row.job.model_copy(update={"id": row.job_id})
        self.summary.retried += 1

    def _write_ready(self, out: TextIO, bar: tqdm) -> None:
        new = 0
        start = self._next_write
        while self._next_write in self._ready:
            line, fresh = self._ready.pop(self._next_write)
            out.write(line)
            new += fresh
            self._next_write += 1
        if self._next_write != start:
            out.flush()
            bar.update(new)
            bar.set_postfix(failed=self.summary.failed, invalid=self.summary.invalid, in_flight=len(self._pending))

    def _report_row(self, kind: str, text: str) -> None:
        count = self._reported[kind] = self._reported.get(kind, 0) + 1
        if count <= REPORT_LIMIT:
            self._report(text)
        elif count == REPORT_LIMIT + 1:
            self._report(f"(more {kind} rows are not reported one by one; see OUT)")


def _truncate_after_lines(path: Path, keep: int) -> None:
    """Cut OUT after its first ``keep`` lines (drops a line a kill left half written)."""
    with path.open("rb+") as f:
        for _ in range(keep):
            f.readline()
        f.truncate(f.tell())
