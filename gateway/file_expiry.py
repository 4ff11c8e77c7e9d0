"""A file's expiry, as OpenAI takes it: ``expires_after`` on an upload (``/v1/files``) and a
batch's ``output_expires_after`` for its output and error files, each ``{"anchor": "created_at",
"seconds": N}``. The file reports ``expires_at`` (its ``created_at`` + N); from then on it is
answered 404, and the feeder's pass deletes it (``FileRemoval.sweep_expired``). An upload without one
expires after ``BatchSettings.default_expires_after`` (30 days, OpenAI's default for purpose
batch; 0: never); a batch's output and error files without one stay until deleted."""

from __future__ import annotations

import re
from typing import Any

from gateway.errors import InvalidRequest, invalid_value

MIN_SECONDS, MAX_SECONDS = 3600, 30 * 24 * 3600  # OpenAI's limits: an hour to 30 days
ANCHOR = "created_at"  # the only anchor OpenAI has
_FIELDS = ("anchor", "seconds")
_INTEGER = re.compile(r"^-?[0-9]{1,12}$")


def expiry_seconds(param: str, value: Any) -> int | None:
    """The ``seconds`` of an expiry object (None when there is none); a 400 naming the field and its rule."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_value(param, value, f'must be an object {{"anchor": "{ANCHOR}", "seconds": N}}')
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise InvalidRequest(f"{param}.{unknown[0]}", f"{param}.{unknown[0]}: not a field of {param} (they are"
                                                      " anchor and seconds)", code="invalid_value")
    anchor, seconds = value.get("anchor"), value.get("seconds")
    if anchor != ANCHOR:
        raise invalid_value(f"{param}.anchor", anchor, f"must be {ANCHOR!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise invalid_value(f"{param}.seconds", seconds, "must be an integer")
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise invalid_value(f"{param}.seconds", seconds, f"must be between {MIN_SECONDS} and {MAX_SECONDS}")
    return seconds


def form_expiry(form: Any, param: str = "expires_after") -> dict[str, Any] | None:
    """The expiry object of a multipart form, whose fields the SDKs send as ``expires_after[anchor]``
    and ``expires_after[seconds]`` (strings: a number among them is read as one)."""
    if param in form:
        raise invalid_value(param, form[param], f"must be sent as the form fields {param}[anchor] and"
                                                f" {param}[seconds]")
    found = {key[len(param) + 1:-1]: value for key, value in form.multi_items()
             if key.startswith(f"{param}[") and key.endswith("]")}
    if not found:
        return None
    seconds = found.get("seconds")
    if isinstance(seconds, str) and _INTEGER.match(seconds):
        found["seconds"] = int(seconds)
    return found
