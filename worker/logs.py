"""Structured logs: ``key=value`` lines or one JSON object per line, through stdlib logging.

Call sites pass their fields as keyword arguments to ``event``::

    event(log, "job.finished", job=job_id, status="done", total_s=0.91)
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_FIELDS = "fields"


def event(logger: logging.Logger, what: str, level: int = logging.INFO, /, *, exc_info: Any = None,
          **fields: Any) -> None:
    """Log the event ``what`` with ``fields`` attached."""
    if logger.isEnabledFor(level):
        logger.log(level, what, extra={_FIELDS: fields}, exc_info=exc_info)


def _quote(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text == "" or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=info logger=worker.loop event=job.finished job=7f3c status=done``"""

    def format(self, record: logging.LogRecord) -> str:
        head = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        fields = {**head, **getattr(record, _FIELDS, {})}
        line = " ".join(f"{k}={_quote(v)}" for k, v in fields.items())
        if record.exc_info:
            line += " exc=" + _quote(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line, same keys as ``KeyValueFormatter``."""

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
            **getattr(record, _FIELDS, {}),
        }
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str, ensure_ascii=False)


def configure(level: str = "INFO", fmt: str = "kv", stream=None) -> None:
    """Route the ``worker`` and ``engine`` loggers to ``stream`` (stderr) in ``fmt``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    for name in ("worker", "engine"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False
