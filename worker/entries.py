"""One queue entry as read from a stream: when it was stored, its raw fields, its job, its id."""

from __future__ import annotations

import json
import re

from producers.protocol import JOB_FIELD, Job, ProtocolError, check_job_id, parse_job


def entry_time(entry_id: str) -> float:
    """Unix seconds at which Redis stored the entry (the first half of its id)."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


def as_text(value) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def raw_entry(fields: dict) -> str:
    """The entry's fields as a JSON object of strings (what a dead letter keeps)."""
    return json.dumps({as_text(k): as_text(v) for k, v in (fields or {}).items()}, ensure_ascii=False)


def parse_entry(fields: dict) -> Job:
    """The job of one stream entry; ``ProtocolError`` naming the bad field otherwise."""
    raw = fields.get(JOB_FIELD.encode(), fields.get(JOB_FIELD))
    if raw is None:
        names = ", ".join(sorted(as_text(k) for k in fields)) or "none"
        raise ProtocolError(f"entry has no '{JOB_FIELD}' field (fields: {names})")
    return parse_job(raw)


_ID_FIELD = re.compile(rb'^\s*\{[^{}\[\]]*?"id"\s*:\s*"([A-Za-z0-9._:@-]{1,128})"')


def readable_id(fields: dict) -> str | None:
    """The job id of an entry that could not be parsed, when one can still be read: from the
    JSON, or else from an ``"id"`` among the leading top-level fields of the text."""
    raw = fields.get(JOB_FIELD.encode(), fields.get(JOB_FIELD))
    try:
        return check_job_id(json.loads(raw).get("id"))
    except Exception:
        pass
    try:
        found = _ID_FIELD.match(raw if isinstance(raw, bytes) else str(raw).encode("utf-8", "replace"))
        return check_job_id(found.group(1).decode()) if found else None
    except Exception:
        return None
