"""A batch's input file read line by line from wherever it is kept, and its validation pass."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

CHUNK = 2**20
_BOM = b"\xef\xbb\xbf"

Read = Callable[[int, int], Awaitable[bytes]]  # (offset, size) -> bytes


@dataclass
class Line:
    number: int  # 1-based
    start: int  # byte offset of the line
    end: int  # byte offset after its "\n"
    raw: bytes | None  # stripped bytes; None: longer than the limit (not held)
    size: int  # bytes of the line without its end


async def file_lines(read: Read, size: int, offset: int = 0, number: int = 0, max_bytes: int = 8 * 2**20,
                     chunk_bytes: int = CHUNK) -> AsyncIterator[Line]:
    """Every non-blank line from ``offset`` (which starts line ``number + 1``), reading
    ``chunk_bytes`` at a time: a line over ``max_bytes`` is dropped as it is read, never held."""
    buf, pos, read_at = b"", 0, offset
    start, dropped = offset, 0  # the current line's offset; its bytes dropped so far (it is too long)
    while True:
        nl = buf.find(b"\n", pos)
        if nl < 0:
            if read_at >= size:
                if len(buf) > pos or dropped:
                    line = _line(number + 1, start, size, buf[pos:], dropped, max_bytes)
                    if line is not None:
                        yield line
                return
            chunk = await read(read_at, min(chunk_bytes, size - read_at))
            if not chunk:
                size = read_at  # the file is shorter than recorded: stop at what there is
                continue
            read_at += len(chunk)
            buf, pos = buf[pos:] + chunk, 0
            if len(buf) > max_bytes + 2 and buf.find(b"\n") < 0:  # +2: room for "\r" and a BOM
                dropped, buf = dropped + len(buf), b""
            continue
        number += 1
        end = start + dropped + (nl - pos) + 1
        line = _line(number, start, end, buf[pos:nl], dropped, max_bytes)
        if line is not None:
            yield line
        pos, start, dropped = nl + 1, end, 0


def _line(number: int, start: int, end: int, kept: bytes, dropped: int, limit: int) -> Line | None:
    if number == 1 and kept.startswith(_BOM):
        kept = kept[len(_BOM):]
    size = dropped + len(kept.rstrip(b"\r"))
    if size > limit:
        return Line(number, start, end, None, size)
    text = kept.strip()
    return Line(number, start, end, text, size) if text else None


@dataclass
class Scan:
    """What the validation pass found."""

    rows: int = 0  # non-blank lines
    objects: int = 0  # lines that are JSON objects
    first_problem: str | None = None  # of the first line that is not one
    duplicates: dict[int, int] = field(default_factory=dict)  # line -> earlier line of its custom_id


async def scan(lines: AsyncIterator[Line], renew: Callable[[], Awaitable[bool]]) -> Scan | None:
    """Count the rows, find the duplicate custom_ids, and whether the file is JSONL at all.
    ``None`` when ``renew`` says the lease was lost on the way."""
    found = Scan()
    first: dict[bytes, int] = {}  # digest of a custom_id -> its first line (held for this pass only)
    async for line in lines:
        found.rows += 1
        if found.rows % 10_000 == 0 and not await renew():
            return None
        try:
            data = json.loads(line.raw) if line.raw is not None else None
        except (ValueError, RecursionError) as exc:  # NOTE: RecursionError: nested past Python's own limit
            data, problem = None, f"line {line.number}: not valid JSON ({str(exc)[:200]})"
        else:
            problem = f"line {line.number}: not a JSON object" if not isinstance(data, dict) else None
        if line.raw is None:
            problem = f"line {line.number}: {line.size:,} bytes, over the line limit"
        if not isinstance(data, dict):
            found.first_problem = found.first_problem or problem
            continue
        found.objects += 1
        custom_id = data.get("custom_id")
        if isinstance(custom_id, str):
            digest = hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).digest()[:16]
            earlier = first.setdefault(digest, line.number)
            if earlier != line.number:
                found.duplicates[line.number] = earlier
    return found
