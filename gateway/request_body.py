"""A route's JSON body, read the one way the routes that take JSON read it.

413 past ``MAX_BODY_BYTES`` (read no further); otherwise a 400 that says what is wrong: not
JSON, nested past the parser's own limit, or an integer too long for Python to convert, which
names the field that holds it (the parser itself names none).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from fastapi import Request

from gateway.errors import APIError, InvalidRequest
from producers.bulk_input import json_depth
from producers.protocol.limits import MAX_INT_DIGITS, MAX_PROMPT_BYTES, Refused, abbreviate

# NOTE: a prompt at MAX_PROMPT_BYTES with every character escaped ("\u0001", 6 bytes), and room for the rest
MAX_BODY_BYTES = 6 * MAX_PROMPT_BYTES + 8 * 2**20


async def json_body(request: Request) -> Any:
    """The body, parsed; 413 past ``MAX_BODY_BYTES``, 400 if it cannot be read as JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _body_too_large(f"is {int(length):,} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _body_too_large(f"is over {MAX_BODY_BYTES:,} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return _parsed(raw)
    except ValueError:  # NOTE: valid JSON whose integer has more digits than Python converts (4,300)
        pass
    try:
        body = _parsed(raw, parse_int=_int_or_refused)
    except ValueError as exc:
        raise InvalidRequest(None, f"the request body is not valid JSON: {exc}") from None
    raise _long_integer(body)


def _parsed(raw: bytes, **hooks: Any) -> Any:
    try:
        return json.loads(raw, **hooks)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(None, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # NOTE: the parser's own limit; a request nests a few levels, a hostile body thousands
        depth = json_depth(raw.decode("utf-8", "replace"))
        raise InvalidRequest(None, f"the request body nests arrays and objects {depth:,} levels deep; the limit is"
                                   f" below {sys.getrecursionlimit():,}") from None


def _body_too_large(size: str) -> APIError:
    return APIError(413, f"the request body {size}; the limit is {MAX_BODY_BYTES:,} bytes", code="request_too_large")


def _int_or_refused(text: str) -> int | Refused:
    try:
        return int(text)
    except ValueError:
        digits = len(text.lstrip("-"))
        return Refused(text, f"an integer of {digits:,} digits; the limit is {MAX_INT_DIGITS} (MAX_INT_DIGITS)")


def _long_integer(body: Any) -> InvalidRequest:
    """The 400 of the body's first integer too long to convert (``_int_or_refused``), naming its
    field; it was a 400 naming none, whose message told the server to raise ``sys.set_int_max_str_digits``."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, Refused):
            return InvalidRequest(path or None, f"{path or 'the request body'}: {abbreviate(value)} is {value.why}",
                                  code="invalid_value")
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend((f"{path}.{key}" if path else str(key), item) for key, item in reversed(list(items)))
    return InvalidRequest(None, "the request body holds an integer too long to read")  # NOTE: not reached
