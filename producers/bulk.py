"""The bulk JSONL pipeline behind ``sluiceway bulk IN.jsonl OUT.jsonl``.

Each non-blank input line is a job object (protocol v1 fields, ``id`` optional). OUT gets
one line per input row, in input order, whatever order the jobs finish in; a line that is not
a job (see ``producers.bulk_input`` for the limits) becomes an ``invalid`` row. Runs resume:
a row without an ``id`` gets one derived from a secret run key kept beside OUT
(``out.jsonl.key`` for ``out.jsonl``), its line number and its bytes, so a re-run submits the
same ids and nobody else can submit a job under them first; submitting an id Redis already
knows enqueues nothing, and the row's result is read from its job hash instead. Rows already
in OUT are not touched.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError
from tqdm import tqdm

from producers.bulk_input import MAX_LINE_BYTES, Row, count_rows, read_rows, run_key
from producers.bulk_output import (
    INVALID, BulkError, check_not_input, ended_well, json_line, output_line, read_out, redis_away,
    truncate_after_lines,
)
from producers.client import Client
from producers.errors import RevisionNotSpoken
from producers.jobs import LIVE_STATUSES, OUTAGE_ERRORS, Outage, block_chunk
from producers.protocol import JobField, JobResult, Status, describe_validation_error

REPORT_LIMIT = 20  # per kind of problem, lines reported one by one before a count
READY_PER_OUTSTANDING = 10  # finished rows held for in-order writing, per outstanding slot
_SWEEP_FIELDS = (JobField.STATUS, JobField.RESULT, JobField.ERROR)
_STATUSES = frozenset(s.value for s in Status)
# NOTE: a run waits on the done signal of its first unfinished row (OUT cannot move on without
# it) and sweeps every row in flight at least this often, so rows that end out of order are
# collected, and their room refilled, within this time. Redis has no atomic wait that leaves
# the signal in place on several lists at once.
WAIT_CHUNK_S = 0.25


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
        max_line_bytes: int = MAX_LINE_BYTES,
        retry_failed: bool = False,
        timeout: float | None = None,
        job_deadline_s: float | None = None,
        progress: bool = True,
        report: Callable[[str], None] | None = None,
    ) -> None:
        if max_outstanding < 1:
            raise BulkError(f"max_outstanding must be >= 1, got {max_outstanding}")
        if max_line_bytes < 1:
            raise BulkError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
        self.client = client
        self.in_path = Path(in_path)
        self.out_path = Path(out_path)
        self.queue = queue
        self.key_path = self.out_path.with_name(self.out_path.name + ".key")
        self.max_outstanding = max_outstanding
        self.max_line_bytes = max_line_bytes
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
        self._key_lost = False  # OUT has rows but the run key that derived their ids is gone

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> BulkSummary:
        if not self.in_path.is_file():
            raise BulkError(f"input {self.in_path} does not exist")
        check_not_input(self.in_path, self.out_path)
        start = time.monotonic()
        deadline = None if self.timeout is None else start + self.timeout
        self.summary.rows = count_rows(self.in_path, self.max_line_bytes)
        written = redo = 0
        for record in read_out(self.out_path):
            written += 1
            redo += not ended_well(record)
        if written > self.summary.rows:
            raise BulkError(f"{self.out_path} has {written} rows but {self.in_path} only {self.summary.rows}")
        key = self._run_key(written)
        rewrite = self._rewrite = self.retry_failed and redo > 0
        tmp = self.out_path.with_name(self.out_path.name + ".tmp")
        out = self._open_out(tmp if rewrite else self.out_path, append=not rewrite, keep=written)
        bar = tqdm(
            total=self.summary.rows, initial=written - (redo if rewrite else 0), unit="row",
            disable=not self.progress, file=sys.stderr, dynamic_ncols=True,
        )
        try:
            rows = read_rows(self.in_path, key, self.job_deadline_s, self.max_line_bytes)
            rows = self._plan(rows, read_out(self.out_path), rewrite)
            self._drive(rows, out, bar, deadline)
        except KeyboardInterrupt:
            self.summary.complete = False
            self._write_ready(out, bar)
            raise
        except OUTAGE_ERRORS as exc:  # past the timeout or the outage window
            self.summary.complete = False
            self._write_ready(out, bar)
            raise redis_away(exc, self.timeout, deadline) from exc
        except BaseException:
            # NOTE: stopped early, so a rewritten OUT is not put in place (it holds only the rows
            # before the stop); the old OUT stays and a re-run resumes from it
            self.summary.complete = False
            raise
        finally:
            self.summary.still_running = len(self._pending)
            self.summary.elapsed_s = time.monotonic() - start
            out.close()
            bar.close()
            if rewrite and self.summary.complete:
                os.replace(tmp, self.out_path)
        return self.summary

    def _run_key(self, written: int) -> bytes:
        try:
            key, made = run_key(self.key_path)
        except ValueError as exc:
            raise BulkError(str(exc)) from None
        except OSError as exc:
            raise BulkError(f"cannot write the run key {self.key_path}: {exc}") from None
        # NOTE: a lost key cannot be recovered (that is the point of it). The rows in OUT stay;
        # rows not yet in OUT start again under new ids, and a job the old run left in flight
        # runs to its end unread.
        self._key_lost = made and written > 0
        if self._key_lost:
            self._report(f"the run key {self.key_path} is missing: the {written} rows in OUT are kept; the other"
                         " rows start again under new ids")
        return key

    def _open_out(self, path: Path, *, append: bool, keep: int) -> TextIO:
        try:
            if append and path.exists():
                truncate_after_lines(path, keep)
            path.parent.mkdir(parents=True, exist_ok=True)
            return path.open("a" if append else "w", encoding="utf-8")
        except OSError as exc:  # NOTE: a read-only filesystem, no permission: the operator's to fix
            raise BulkError(f"cannot write {path}: {exc}") from None

    def _plan(self, rows: Iterator[Row], old: Iterator[dict[str, Any]], rewrite: bool) -> Iterator[Row]:
        """IN's rows, each matched with its OUT row if it has one (``prior``); a row to be
        retried comes out with its next attempt's id."""
        for row in rows:
            prior = next(old, None)
            if prior is None:
                yield row
                continue
            row.attempt = int(prior.get("attempt") or 0)
            if not self._same_row(prior, row):
                raise BulkError(
                    f"{self.out_path} row {row.seq + 1} is line {prior.get('line')} id {prior.get('id')}, but"
                    f" {self.in_path} row {row.seq + 1} is line {row.line} id {row.job_id}: OUT was written for"
                    " another input; give a new OUT path"
                )
            if rewrite and not ended_well(prior):
                self._retry(row)
            else:
                row.prior = prior
                self.summary.kept += 1
            yield row

    def _same_row(self, prior: dict[str, Any], row: Row) -> bool:
        if prior.get("line") != row.line:
            return False
        if self._key_lost and not row.explicit_id:  # its id came from the lost key
            return (prior.get("id") is None) == (row.job_id is None)
        return prior.get("id") == row.job_id

    def _drive(self, rows: Iterator[Row], out: TextIO, bar: tqdm, deadline: float | None) -> None:
        rows = iter(rows)
        exhausted = False
        # NOTE: the timeout bounds a wait for Redis too; the client's own rides inside (submit_many's)
        # count on this ride's clock and stop at its deadline, so an outage is ridden for one window
        with Outage(deadline=deadline) as outage:
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
                    if deadline is not None and time.monotonic() >= deadline:
                        raise  # NOTE: Redis still away when the timeout ran out: its error, as Client.result raises it
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
        batch = [row for row in batch if self._readable(row)]
        if batch:
            # NOTE: pending first: if the submission is cut off, the sweep finds no job hash for
            # these ids and submits them again. Ids Redis already knows (a resumed run) are not
            # enqueued again; the sweep finds their end in the job hash.
            self._pending.update((row.job_id, row) for row in batch)
            self.client.submit_many([row.job for row in batch], queue=self.queue)

    def _readable(self, row: Row) -> bool:
        """Whether the queue's live workers read ``row``'s job; one of a later protocol revision than
        they speak (``tools`` to workers of 1.2) ends failed, naming the field, rather than be submitted.

        NOTE: failed, not invalid: the job is valid, and ``--retry-failed`` once they are upgraded runs it"""
        try:
            self.client.check_revision(row.job, self.queue)
        except RevisionNotSpoken as exc:
            self.summary.failed += 1
            self._report_row("failed", f"line {row.line}: job {row.job_id} not submitted: {exc}")
            self._ready[row.seq] = (output_line(row, Status.FAILED.value, error=str(exc)), True)
            return False
        return True

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
            elif status not in _STATUSES:
                ended = True
                unknown = f"its hash holds an unknown status {status!r:.60}"
                self._end(self._pending.pop(job_id), Status.FAILED, None, unknown)
            elif Status(status).terminal:
                ended = True
                self._end(self._pending.pop(job_id), Status(status), result, error)
        self._submit(lost)
        return ended

    def _wait(self, deadline: float | None) -> None:
        """Block until the first row in flight signals its end, or ``WAIT_CHUNK_S`` passes."""
        # NOTE: Redis reads a block of 0.001 s as 0 ms, which means "forever"; 0.01 s is safe.
        left = None if deadline is None else max(0.01, deadline - time.monotonic())
        head = min(self._pending.values(), key=lambda row: row.seq).job_id
        done_key = self.client.keys.done(head)
        # NOTE: as in Client.result: moving the list's element onto the same list is an atomic
        # rotation, so the signal stays for every other waiter even if this process dies here.
        chunk = block_chunk(left, self.client.socket_timeout, cap=WAIT_CHUNK_S)
        signal = self.client.redis.blmove(done_key, done_key, chunk, "RIGHT", "LEFT")
        if signal is not None and self.client.redis.hget(self.client.keys.job(head), JobField.STATUS) in LIVE_STATUSES:
            time.sleep(0.01)  # a worker that signals before it writes the hash: let it finish

    # -- ends of rows -----------------------------------------------------------------------

    def _end(self, row: Row, status: Status, result: str | None, error: str | None) -> None:
        parsed = None
        if status is Status.DONE and result is None:
            status, error = Status.FAILED, "the job is done but its hash holds no result"
        elif status is Status.DONE:
            try:
                parsed = JobResult.model_validate_json(result)
            except ValidationError as exc:
                status = Status.FAILED
                error = f"the job is done but its result is not valid: {describe_validation_error(exc)}"
        if parsed is not None:
            self.summary.done += 1
            self.summary.prompt_tokens += parsed.usage.prompt_tokens
            self.summary.completion_tokens += parsed.usage.completion_tokens
            self._ready[row.seq] = (output_line(row, Status.DONE.value, result=parsed), True)
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
