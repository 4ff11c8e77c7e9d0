"""What a file or batch hash of the Batch API holds (``gateway.batch_store`` keeps them in Redis):
whether it is a whole record, whether a tenant may see it, and its OpenAI object; and the ids
of a batch's output and error files."""

from __future__ import annotations

import json
import math
from typing import Any

from producers.protocol.batch_statuses import BatchStatus

REDIS, DIRECTORY, LINES = "redis", "dir", "lines"  # where a file's bytes are
_FILE_FIELDS = ("id", "bytes", "created_at", "filename", "purpose")


def visible(meta: dict[str, str], tenant: str, now: float) -> bool:
    """Whether a file hash is a file ``tenant`` may see.

    NOTE: an expired file is gone from its expires_at on, whether or not a sweep has deleted it yet."""
    return whole_file(meta) and meta.get("tenant") == tenant and not expired(meta, now)


def whole_file(meta: dict[str, str]) -> bool:
    """Whether a file hash holds every field its file object and its bytes are read from, each a value
    of its kind.

    NOTE: a part of one is no file: a batch create racing the file's delete writes its ``batch``
    field back alone, and a hash may be written by hand. Read as a file, a missing ``bytes`` or a
    ``storage`` of no known kind was a 500."""
    try:
        numbers = (int(meta["bytes"]), int(meta["created_at"]), float(meta.get("expires_at") or 0))
    except (KeyError, ValueError):
        return False
    storage = meta.get("storage")
    return (all(math.isfinite(n) for n in numbers) and all(meta.get(name) for name in ("id", "tenant", "purpose"))
            and "filename" in meta and storage in (REDIS, DIRECTORY, LINES)
            and (storage != LINES or bool(meta.get("lines"))))


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's ``output`` or ``error`` file (as secret as the batch's own id)."""
    return f"file-{batch_id.removeprefix('batch_')}-{kind}"


def output_of(file_id: str) -> tuple[str, str] | None:
    """The batch and the kind (``output``, ``error``) whose file ``output_file_id`` names ``file_id``;
    None for any other id (an upload's)."""
    for kind in ("output", "error"):
        batch_id = "batch_" + file_id.removeprefix("file-").removesuffix(f"-{kind}")
        if output_file_id(batch_id, kind) == file_id:
            return batch_id, kind
    return None


def only_batch_field(meta: dict[str, str]) -> str | None:
    """The batch named by a file hash that holds nothing but a ``batch`` field (None for any other hash).

    NOTE: what a batch create racing the file's delete leaves: the delete removed the hash, then the
    create wrote its ``batch`` field back. No index names it, so it is no part of a tenant's files."""
    return (meta["batch"] or None) if set(meta) == {"batch"} else None


def expired(meta: dict[str, str], now: float) -> bool:
    """Whether a file hash's ``expires_at`` has come (a file without one never expires)."""
    return bool(meta.get("expires_at")) and float(meta["expires_at"]) <= now


def file_object(meta: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI ``file`` object of a file hash."""
    obj = {name: meta[name] for name in _FILE_FIELDS}
    obj.update(bytes=int(obj["bytes"]), created_at=int(obj["created_at"]), object="file", status="processed",
               status_details=None, expires_at=int(meta["expires_at"]) if meta.get("expires_at") else None)
    return obj


_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")


_BATCH_FIELDS = ("id", "tenant", "status", "endpoint", "input_file_id", "completion_window")
_STATUSES = frozenset(status.value for status in BatchStatus)


def whole_batch(meta: dict[str, str]) -> bool:
    """Whether a batch hash holds every field its batch object is read from, each a value of its kind.

    NOTE: as ``whole_file``: a part of one (a field missing, a time or count not a number, errors
    or metadata not JSON, a status of no known kind) is no batch; read as one it was a 500."""
    try:
        times = [float(meta[name]) for name in ("created_at", "expires_at")]
        times += [float(meta[name]) for name in _TIMES if meta.get(name)]
        counts = [int(meta.get(name) or 0) for name in ("total", "completed", "failed")]
        documents = [json.loads(meta.get(name) or "null") for name in ("errors", "metadata")]
    except (KeyError, ValueError):
        return False
    return (all(math.isfinite(t) for t in times) and min(counts) >= 0
            and all(d is None or isinstance(d, dict) for d in documents)
            and all(meta.get(name) for name in _BATCH_FIELDS) and meta["status"] in _STATUSES)


def batch_object(meta: dict[str, str]) -> dict[str, Any]:
    """The OpenAI ``batch`` object of a batch hash."""
    obj: dict[str, Any] = {
        "id": meta["id"], "object": "batch", "endpoint": meta["endpoint"], "input_file_id": meta["input_file_id"],
        "completion_window": meta["completion_window"], "status": meta["status"],
        "output_file_id": meta.get("output_file_id") or None, "error_file_id": meta.get("error_file_id") or None,
        "errors": json.loads(meta["errors"]) if meta.get("errors") else None,
        "request_counts": {"total": int(meta.get("total") or 0), "completed": int(meta.get("completed") or 0),
                           "failed": int(meta.get("failed") or 0)},
        "metadata": json.loads(meta["metadata"]) if meta.get("metadata") else None,
    }
    for name in _TIMES:
        obj[name] = int(float(meta[name])) if meta.get(name) else None
    return obj
