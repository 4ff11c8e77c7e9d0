"""OUT of ``sluiceway bulk``: one JSON object line per input row, read back on resume."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from producers.bulk_input import Row
from producers.jobs import OUTAGE_WINDOW_S
from producers.protocol import JobResult, Status

INVALID = "invalid"  # the status of an output row whose input line is not a valid job
OUT_FIELDS = frozenset({"line", "id", "status"})  # what a resumed run reads of each row of OUT
_ROW_START = b'{"line": '  # how every row written by output_line (and json_line of a row read back) begins


class BulkError(Exception):
    """The run cannot start or go on (e.g. OUT belongs to another input)."""


def redis_away(exc: Exception, timeout: float | None, deadline: float | None) -> BulkError:
    """The error that ends a run Redis did not answer: until its timeout ran out, or for the outage window."""
    if deadline is not None and time.monotonic() >= deadline:
        how_long = f"before the run's timeout ({timeout:g}s) ran out"
    else:
        how_long = f"for {OUTAGE_WINDOW_S:g}s"
    return BulkError(f"redis did not answer {how_long} ({exc}); stopped early: run again to resume")


def read_out(path: Path) -> Iterator[dict[str, Any]]:
    """The complete rows of an existing OUT; a line cut short by a kill is left out."""
    if not path.exists():
        return
    with path.open("rb") as f:  # NOTE: OUT's lines end in b"\n" only, like IN's
        for number, text in enumerate(f, start=1):
            if not text.endswith(b"\n"):
                if not (text.startswith(_ROW_START) or _ROW_START.startswith(text)):
                    raise BulkError(f"{path}:{number} is not a bulk output row cut short by a kill: OUT is not a"
                                    " bulk output file; give a new OUT path")
                return  # the write a kill interrupted
            try:
                record = json.loads(text)
            except ValueError:  # also bad UTF-8 and overlong numbers
                record = None
            # NOTE: checked on every row before OUT is touched: a file that is not a bulk run's OUT
            # (the input itself, someone's JSONL) is refused before its last line is cut as half written
            if not isinstance(record, dict) or not OUT_FIELDS <= record.keys():
                raise BulkError(f"{path}:{number} is not a row of a bulk output (an object with"
                                f" {', '.join(sorted(OUT_FIELDS))}): OUT is not a bulk output file; give a new OUT path")
            yield record


def ended_well(record: dict[str, Any]) -> bool:
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


def truncate_after_lines(path: Path, keep: int) -> None:
    """Cut OUT after its first ``keep`` lines (drops a line a kill left half written)."""
    with path.open("rb+") as f:
        for _ in range(keep):
            f.readline()
        f.truncate(f.tell())


def check_not_input(in_path: Path, out_path: Path, what: str = "OUT") -> None:
    """Refuse an output path that is the input file itself (a typo, a link): it would be read as OUT."""
    if out_path.exists() and in_path.exists() and in_path.samefile(out_path):
        raise BulkError(f"{what} {out_path} is the input file {in_path}; give another path")
