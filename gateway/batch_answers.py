"""Where a batch's answered lines go: Redis lists, or (with ``files_dir``) their files, at once.

A batch records which at validation (its hash's ``answers``: ``lines`` or ``dir``), so every
gateway that holds it afterwards writes the same way.

- ``lines``: each answer is one ``ANSWER_LINE_SCRIPT`` call (bit, counter, the line appended to
  the batch's Redis list). Redis then holds every output and error line until the batch ends:
  ``max_rows_in_redis`` bounds a batch's rows so (validation refuses a larger file).
- ``dir``: the answers of one step (a chunk of lines fed, or one collect pass) are appended
  to the output and error files at the offsets Redis recorded, fsynced, and then recorded by
  one ``RECORD_ANSWERS_SCRIPT`` call (bits, counters, the new offsets, fenced by the lease).
  Redis keeps no line: its memory stays flat however many rows the batch has. A holder killed
  between the append and the record leaves bytes past the recorded offset, which its
  successor cuts off (``truncate``) before it writes: each line is in its file exactly once.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.batch_records import output_file_id
from producers.protocol.batch_scripts import RECORD_ANSWERS_SCRIPT

if TYPE_CHECKING:
    from gateway.batch_lines import BatchLines

DIR, LINES = "dir", "lines"  # a batch hash's ``answers``
KINDS = {"output": ("output", "output_bytes"), "errors": ("error", "errors_bytes")}  # kind -> (file kind, field)


class AnswersLost(RuntimeError):
    """The record was refused: this gateway lost the batch's lease, or its offsets moved."""


@dataclass
class _Answer:
    line: int
    job_ids: list[str]  # the line's jobs, whose pending entries go with the answer (none: a line that never ran)
    text: str
    counter: str
    kind: str  # "output" or "errors"


def write_at(path: Path, offset: int, data: bytes) -> int:
    """Write ``data`` at ``offset`` (what lies past it is a dead holder's), fsync; the new end."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        size = os.fstat(fd).st_size
        if size < offset:
            raise AnswersLost(f"{path} holds {size:,} bytes but Redis recorded {offset:,}: the file lost answers")
        os.pwrite(fd, data, offset)
        os.ftruncate(fd, offset + len(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    return offset + len(data)


def truncate(path: Path, size: int) -> None:
    """Cut ``path`` to the ``size`` Redis recorded (a takeover: bytes a killed holder appended)."""
    if path.exists() and path.stat().st_size > size:
        with path.open("r+b") as f:
            f.truncate(size)
            os.fsync(f.fileno())


class Answers:
    """The lines one step answers, written as the batch's ``answers`` says; ``flush`` before the
    step's own pipeline runs (which moves the cursor, or deletes the answered jobs' keys)."""

    def __init__(self, lines: BatchLines, batch_id: str, meta: dict[str, str], pipe: Any) -> None:
        self.lines = lines
        self.batch_id = batch_id
        self.to_dir = meta.get("answers") == DIR
        self.pipe = pipe
        self.queued: list[_Answer] = []

    async def add(self, line: int, job_ids: list[str], text: str, counter: str, kind: str) -> None:
        if self.to_dir:
            self.queued.append(_Answer(line, job_ids, text, counter, kind))
        else:
            await self.lines.answer_call(self.pipe, self.batch_id, line, job_ids, text, counter, kind)

    async def flush(self) -> None:
        if not self.queued:
            return
        queued, self.queued = self.queued, []
        await record(self.lines, self.batch_id, queued)


def path_of(lines: BatchLines, batch_id: str, kind: str) -> Path:
    if not lines.settings.files_dir:
        raise AnswersLost(f"batch {batch_id} keeps its answers in files_dir, which this gateway has not set")
    return lines.store.path(output_file_id(batch_id, KINDS[kind][0]))


async def record(lines: BatchLines, batch_id: str, queued: list[_Answer]) -> None:
    """Append the texts of the lines not answered yet, then record them all in one script."""
    redis, keys = lines.redis, lines.keys
    bits = await lines.bits(batch_id, [a.line for a in queued])
    data: dict[str, list[bytes]] = {"output": [], "errors": []}
    seen: set[int] = set()
    for answer, bit in zip(queued, bits):
        if not bit and answer.line not in seen and answer.text:
            data[answer.kind].append(answer.text.encode())
        seen.add(answer.line)
    # NOTE: the lease is checked before the write as well as (atomically) in the record: a
    # holder that lost it must not write over what its successor appended and not yet recorded.
    # What is left is a holder paused between this check and its write for longer than the
    # lease (lease_seconds, 10 s by default), which the record then refuses.
    if await redis.get(keys.lease(batch_id)) != lines.holder:
        raise AnswersLost(f"batch {batch_id}: this gateway no longer holds its lease")
    before = [int(x or 0) for x in await redis.hmget(keys.batch(batch_id), ["output_bytes", "errors_bytes"])]
    after = list(before)
    for i, kind in enumerate(("output", "errors")):
        if data[kind]:
            after[i] = await asyncio.to_thread(write_at, path_of(lines, batch_id, kind), before[i],
                                               b"".join(data[kind]))
    args: list[Any] = [lines.holder, before[0], after[0], before[1], after[1]]
    for answer in queued:
        args += [answer.line, " ".join(answer.job_ids), answer.counter]
    keys_ = [keys.batch(batch_id), keys.answered(batch_id), keys.pending(batch_id), keys.lease(batch_id)]
    done = await lines.record_script(keys=keys_, args=args)
    if done < 0:
        raise AnswersLost(f"batch {batch_id}: answers not recorded ({'lease lost' if done == -1 else 'offsets moved'})")


async def cut_to_record(lines: BatchLines, batch_id: str, meta: dict[str, str]) -> None:
    """On taking a batch: cut its files to the offsets Redis recorded."""
    if meta.get("answers") != DIR or not lines.settings.files_dir:
        return
    for kind, (_, field) in KINDS.items():
        await asyncio.to_thread(truncate, path_of(lines, batch_id, kind), int(meta.get(field) or 0))
