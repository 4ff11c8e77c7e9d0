"""Reading a bulk input file: bounded lines, strict JSON, row ids nobody else can compute.

Lines are split on ``b"\\n"`` only (one trailing ``\\r`` is dropped, so CRLF files work) and
read in bounded pieces: a line over ``MAX_LINE_BYTES`` is skipped to its end, never held.
Whatever a line holds, it becomes a ``Row``: a job, or an error naming the line, the problem
and the limit (written to OUT as an ``invalid`` row). Nothing a line holds raises out of here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from producers.protocol import MAX_ID_LENGTH, Job, describe_validation_error

MAX_LINE_BYTES = 8 * 2**20  # one input line, without its line end; a longer line is an invalid row
MAX_JSON_DEPTH = 64  # arrays and objects inside each other; a job needs 3 or 4
# NOTE: no job field needs a longer integer, and Python's int() is quadratic in the digits
# (its own guard, 4,300 digits by default, can be switched off by the environment).
MAX_INT_DIGITS = 1000
MAX_ERROR_CHARS = 500  # an error quotes at most this much of what it complains about
RUN_KEY_BYTES = 32  # 256 secret bits per run
_BLOCK = 2**20  # bytes read at a time
# NOTE: possessive (Python 3.11) and with an optional close, so a hostile line (one quote, then
# millions of escaped quotes) is scanned once, in bounded memory, never backtracked over.
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NUMBER_SHAPE = bytes(ord("0") if chr(b).isdigit() and b < 128 else ord("e") if b in b"eE" else ord("+")
                      if b in b"+-" else ord(" ") for b in range(256))  # for bytes.translate
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_BOM = b"\xef\xbb\xbf"


class BadLine(ValueError):
    """A line that is not a job (raised inside this module only, to become an invalid row)."""


@dataclass
class Row:
    """One non-blank input line and what becomes of it."""

    seq: int  # position among the input's rows (= line in OUT)
    line: int  # 1-based line number in IN
    base_id: str | None  # the id of its first attempt (None: the line is not a job)
    job: Job | None = None
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    explicit_id: bool = False  # the line names its own id (else it is derived from the run key)
    attempt: int = 0
    retried: bool = False  # retried once already in this run
    prior: dict[str, Any] | None = None  # its row in OUT, when that row stays as it is

    @property
    def job_id(self) -> str | None:
        return None if self.base_id is None else attempt_id(self.base_id, self.attempt)


# -- ids --------------------------------------------------------------------------------------


def run_key(path: Path) -> tuple[bytes, bool]:
    """The secret of the run that writes OUT, from its sidecar ``path``; made (mode 0600) if
    there is none. Returns the key and whether it was made now."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the run key {path}: {exc}") from None
    else:
        if not re.fullmatch(f"[0-9a-f]{{{2 * RUN_KEY_BYTES}}}", text):
            raise ValueError(
                f"the run key {path} is damaged (it should hold {2 * RUN_KEY_BYTES} hex digits); delete it to go"
                " on: rows already in OUT are kept, the others start again under new ids"
            )
        return bytes.fromhex(text), False
    key = secrets.token_bytes(RUN_KEY_BYTES)
    path.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: written whole to a private temporary file (mkstemp makes it 0600), then renamed:
    # a kill never leaves half a key behind.
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(key.hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return key, True


def derived_id(key: bytes, line: int, raw: bytes) -> str:
    """The id of a row that names none: a keyed hash of its line number and bytes, so the same
    run (same key) derives the same ids and nobody without the key can compute one."""
    digest = hmac.new(key, b"%d\n" % line + raw, hashlib.sha256).hexdigest()
    return "bulk-" + digest[:32]  # 128 bits


def attempt_id(base_id: str, attempt: int) -> str:
    """The id of a row's ``attempt``-th retry (0 is the row's own id)."""
    if attempt == 0:
        return base_id
    retry = f"{base_id}.r{attempt}"
    if len(retry) <= MAX_ID_LENGTH:
        return retry
    return "bulk-" + hashlib.sha256(retry.encode()).hexdigest()[:32]


# -- lines ------------------------------------------------------------------------------------


def input_lines(path: Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes | int]]:
    """``(line number, bytes)`` for each non-blank line; ``(line number, size)`` for a line over
    ``max_line_bytes``, whose bytes were dropped as they were read, never held."""
    number = 0
    carry = b""  # the start of the current line, while it is within the limit
    dropped, last = 0, b""  # bytes of the current line dropped so far (it is over the limit), the last one
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            *ended, tail = block.split(b"\n")
            for part in ended:
                number += 1
                found = _line(number, carry + part if carry else part, dropped, last, max_line_bytes)
                if found is not None:
                    yield found
                carry, dropped, last = b"", 0, b""
            if dropped or len(carry) + len(tail) > max_line_bytes + 1:  # +1: room for a "\r"
                dropped, last, carry = dropped + len(carry) + len(tail), tail[-1:] or carry[-1:] or last, b""
            else:
                carry += tail
    if carry or dropped:
        found = _line(number + 1, carry, dropped, last, max_line_bytes)
        if found is not None:
            yield found


def _line(number: int, kept: bytes, dropped: int, last: bytes, limit: int) -> tuple[int, bytes | int] | None:
    """One line without its ``\\n``: ``kept`` is all of it, or what came after ``dropped`` bytes."""
    crlf = kept.endswith(b"\r") if kept else last == b"\r"
    size = dropped + len(kept) - crlf
    if size > limit:
        return number, size
    text = kept[:-1] if crlf else kept
    if number == 1 and text.startswith(_BOM):
        text = text[len(_BOM):]
    text = text.strip()
    return (number, text) if text else None


def count_rows(path: Path, max_line_bytes: int = MAX_LINE_BYTES) -> int:
    return sum(1 for _ in input_lines(path, max_line_bytes))


def read_rows(
    path: Path, key: bytes, job_deadline_s: float | None = None, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[Row]:
    """Every non-blank line of ``path`` as a ``Row``, in order; a later row that repeats an
    explicit id of an earlier one is invalid (two rows cannot share one job)."""
    first_line: dict[str, int] = {}
    for seq, (line, raw) in enumerate(input_lines(path, max_line_bytes)):
        if isinstance(raw, int):
            yield Row(seq, line, None, error=f"line {line}: the line is {raw:,} bytes long; the limit is"
                                             f" {_size(max_line_bytes)}")
            continue
        row = parse_row(seq, line, raw, key, job_deadline_s=job_deadline_s)
        if row.explicit_id and row.base_id is not None:
            earlier = first_line.setdefault(row.base_id, line)
            if earlier != line:
                row = Row(seq, line, None, metadata=row.metadata, error=f"line {line}: id {_quote(row.base_id)}"
                          f" is already the id of line {earlier}; ids must be unique within a file")
        yield row


def parse_row(seq: int, line: int, raw: bytes, key: bytes, *, job_deadline_s: float | None = None) -> Row:
    """One input line as a row; an invalid line becomes a row whose ``error`` names the problem."""
    metadata: dict[str, Any] = {}
    try:
        data = parse_line(raw)
        metadata = data["metadata"] if isinstance(data.get("metadata"), dict) else {}
        explicit = "id" in data
        data.setdefault("id", derived_id(key, line, raw))
        if job_deadline_s is not None and data.get("deadline") is None:
            data["deadline"] = time.time() + job_deadline_s
        job = Job.model_validate(data)
        job.to_json()  # what submitting it will do
    except BadLine as exc:
        return Row(seq, line, None, error=f"line {line}: {exc}")
    except ValidationError as exc:
        return Row(seq, line, None, error=f"line {line}: {_cut(describe_validation_error(exc))}", metadata=metadata)
    except Exception as exc:  # NOTE: one odd line must not stop the run; it is named, not raised
        return Row(seq, line, None, error=f"line {line}: not a valid job: {_cut(f'{type(exc).__name__}: {exc}')}",
                   metadata=metadata)
    return Row(seq, line, job.id, job=job, metadata=metadata, explicit_id=explicit)


def parse_line(raw: bytes) -> dict[str, Any]:
    """A line's JSON object, or ``BadLine`` naming what is wrong and the limit it broke."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadLine(f"not valid UTF-8: byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} ({exc.reason})") from None
    # NOTE: a line with few brackets cannot nest past the limit: most lines are not scanned
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and (depth := json_depth(text)) > MAX_JSON_DEPTH:
        raise BadLine(f"JSON nested {depth:,} levels deep; the limit is {MAX_JSON_DEPTH}")
    # NOTE: the number hooks cost a call per number (a row of token ids holds thousands); only a
    # line with a run of 101 digits or a 3-digit exponent can hold a number they would refuse.
    checked = {"parse_int": _parse_int, "parse_float": _parse_float} if _long_number(raw) else {}
    try:
        data = json.loads(text, parse_constant=_parse_constant, **checked)
    except BadLine:
        raise
    except ValueError as exc:
        raise BadLine(f"not valid JSON: {_cut(str(exc))}") from None
    if not isinstance(data, dict):
        raise BadLine(f"a job must be a JSON object, got {type(data).__name__}")
    if "\\u" in text:  # NOTE: valid UTF-8 cannot hold a surrogate; only an escape can make one
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadLine(f"a string holds the lone surrogate \\u{ord(exc.object[exc.start]):04x},"
                          " which is not valid Unicode") from None
    return data


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in ``text`` (strings skipped), counted without recursion."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(_DEPTH_STEP[c] for c in brackets), default=0)


def _long_number(raw: bytes) -> bool:
    shape = raw.translate(_NUMBER_SHAPE)  # C speed, unlike a regex search over every position
    return b"0" * 101 in shape or b"e000" in shape or b"e+000" in shape


def _parse_int(literal: str) -> int:
    digits = len(literal) - literal.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise BadLine(f"a number has {digits:,} digits ({literal[:20]}...); the limit is {MAX_INT_DIGITS:,}")
    return int(literal)


def _parse_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise BadLine(f"the number {_cut(literal, 40)} is too large for a double")
    return value


def _parse_constant(literal: str) -> float:
    raise BadLine(f"{literal} is not a JSON number (NaN and Infinity are not allowed)")


def _cut(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"


def _quote(value: str) -> str:
    return repr(_cut(value, 80))


def _size(n: int) -> str:
    return f"{n:,} bytes" + (f" ({n // 2**20} MiB)" if n % 2**20 == 0 else "")
