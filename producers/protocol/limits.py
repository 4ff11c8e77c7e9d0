"""Protocol v1's size limits and the checks that keep hostile bytes from hurting a worker.

Every limit is a constant here, listed in PROTOCOL.md ("Limits") and enforced twice: by
the worker when it reads an entry (``parse_job``) and by the client's ``make_job``, so a
producer hears of a breach before it enqueues. Every check is cheap and runs before any
heavy work (parsing a huge number, tokenizing, allocating ``n`` sequences), and none
recurses, so no input can raise anything but a ``ValueError`` naming the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_ENTRY_BYTES = 8 * 1024 * 1024  # the `job` value, as stored in the stream
MAX_JSON_DEPTH = 32  # arrays and objects inside one another, the job object itself counted as 1
MAX_JSON_CONTAINERS = 10_000  # arrays and objects in one job, all together
MAX_INT_DIGITS = 64  # digits of any integer (a 128-bit id fits; Python's own limit is 4,300)
MAX_PROMPT_BYTES = 4 * 1024 * 1024  # `prompt` in UTF-8; also every message `content` (and tool call) together
MAX_PROMPT_TOKEN_IDS = 512 * 1024  # entries of `prompt_token_ids`
MAX_MESSAGES = 1024  # entries of `messages`
MAX_METADATA_BYTES = 64 * 1024  # `metadata` as compact UTF-8 JSON (it is copied into the result)
MAX_N = 128  # `sampling.n`: completions of one job (each is a sequence the engine runs)
MAX_STOP_STRINGS = 32  # entries of `sampling.stop` (each is searched after every token)
MAX_STOP_STRING_CHARS = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024  # entries of `sampling.stop_token_ids`
MAX_BAD_WORDS = 256  # entries of `sampling.bad_words` (each is matched after every token)
MAX_LOGIT_BIAS = 1024  # entries of `sampling.logit_bias`
MAX_CONTINUATIONS = 256  # entries of `score.continuations` (each is a sequence the engine runs)
MAX_TOOLS = 128  # entries of `tools` (OpenAI's own limit)
MAX_ALLOWED_TOKEN_IDS = 262_144  # entries of `sampling.allowed_token_ids` (more than any vocabulary)
# `sampling.structured_outputs` as compact UTF-8 JSON: the worker parses a new constraint on
# its step thread (a schema this size in tens of milliseconds) before compiling it off it
MAX_STRUCTURED_OUTPUTS_BYTES = 256 * 1024

ID_SCAN_CHARS = 64 * 1024  # how far an entry that will not be parsed is searched for its id
LIMITS = {name: value for name, value in globals().items() if name.startswith("MAX_")}

_SURROGATE = re.compile("[\ud800-\udfff]")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # one JSON string token, escapes included
_BRACKET = re.compile(r"[\[\]{}]")
_TOKEN = re.compile(f"{_STRING.pattern}|{_BRACKET.pattern}", re.S)  # brackets inside strings are skipped
# every ASCII digit to "1", every other byte to ".": a run of digits past the limit is then one substring search
_DIGIT_MAP = bytes(0x31 if 0x30 <= b <= 0x39 else 0x2E for b in range(256))
_LONG_RUN = b"1" * (MAX_INT_DIGITS + 1)
_KEY_COLON = re.compile(r"\s*:\s*")
_VALUE_STRING = re.compile(r'"([A-Za-z0-9._:@-]{1,128})"')


class Refused:
    """A JSON number the parser would not turn into a value (too many digits, NaN, overflow).

    ``parse_job``'s hooks put one in the tree in place of the number, so the walk that
    follows can name the field it sits in instead of failing the whole entry unread.
    """

    __slots__ = ("text", "why")

    def __init__(self, text: str, why: str) -> None:
        self.text = text
        self.why = why


def loads(text: str) -> Any:
    """``json.loads`` that never fails on a number: one it will not parse becomes a ``Refused``."""
    # NOTE: the integer hook costs ~5x on long lists of token ids, so it is used only when
    # the text holds a digit run long enough to need it. Finding one by regex cost 0.5 ms for
    # 1,716 token ids (more than the parse); byte translation and a substring search, 20 us.
    hooks = {"parse_int": parse_int} if has_long_digit_run(text) else {}
    return json.loads(text, parse_float=parse_float, parse_constant=parse_constant, **hooks)


def has_long_digit_run(text: str) -> bool:
    """Whether ``text`` holds more than ``MAX_INT_DIGITS`` ASCII digits in a row (JSON numbers are ASCII)."""
    return _LONG_RUN in text.encode("utf-8", "surrogatepass").translate(_DIGIT_MAP)


def parse_int(text: str) -> int | Refused:
    """``json.loads``'s ``parse_int``: an integer of too many digits is kept unparsed."""
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return Refused(text, f"an integer of {digits:,} digits; the limit is {MAX_INT_DIGITS} (MAX_INT_DIGITS)")
    return int(text)


def parse_float(text: str) -> float | Refused:
    """``json.loads``'s ``parse_float``: an overflow (``1e999``) or an absurdly long number is kept unparsed."""
    if len(text) > 2 * MAX_INT_DIGITS:
        return Refused(text, f"a number of {len(text):,} characters; the limit is {2 * MAX_INT_DIGITS}")
    value = float(text)
    if not math.isfinite(value):
        return Refused(text, "too large for a double (it would be infinite); numbers must be finite")
    return value


def parse_constant(text: str) -> Refused:
    """``json.loads``'s ``parse_constant``: ``NaN``, ``Infinity`` and ``-Infinity`` are refused."""
    return Refused(text, "not a finite number (NaN and Infinity are not allowed)")


def abbreviate(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for error messages."""
    text = repr(value) if not isinstance(value, Refused) else value.text
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-12:]} ({len(text):,} chars)"


def structure_problem(text: str) -> str | None:
    """Why ``text`` is too deep or has too many arrays and objects to parse, or None; no recursion.

    Strings are blanked first (a C-speed pass), so only brackets cost a Python step, and
    the count stops at the first bracket past either limit.
    """
    # NOTE: fewer opening brackets in the whole text (strings too) than either limit allows
    # cannot break one: a job of token ids (three) skips the blanking pass, ~0.15 ms at 4,096 ids
    if text.count("[") + text.count("{") <= min(MAX_JSON_DEPTH, MAX_JSON_CONTAINERS):
        return None
    depth = count = 0
    for match in _BRACKET.finditer(_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            count += 1
            if depth > MAX_JSON_DEPTH:
                return f"nested deeper than {MAX_JSON_DEPTH} levels (MAX_JSON_DEPTH)"
            if count > MAX_JSON_CONTAINERS:
                return f"more than {MAX_JSON_CONTAINERS:,} arrays and objects (MAX_JSON_CONTAINERS)"
        else:
            depth -= 1
    return None


def scan_id(text: str) -> str | None:
    """The job's id read from JSON text that will not be parsed (too large, too deep, broken).

    NOTE: conservative on purpose. Only the first ``ID_SCAN_CHARS`` characters are looked
    at (the reference client writes ``id`` second, after ``v``), and only a key ``"id"`` of
    the outermost object whose value is a plain string of id characters counts, so a nested
    ``"id"`` (in metadata, say) is never taken for the job's. It lets an entry that cannot
    be parsed still fail its own job, so a client waiting on it wakes up.
    """
    text = text[:ID_SCAN_CHARS]
    depth = 0
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
        elif token in "]}":
            depth -= 1
        elif depth == 1 and token == '"id"':
            colon = _KEY_COLON.match(text, match.end())
            value = _VALUE_STRING.match(text, colon.end()) if colon is not None else None
            if value is not None:
                return value.group(1)
    return None


def check_tree(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Walk a JSON value without recursion; ``ValueError`` naming the first bad place.

    Bad: nesting past ``max_depth``, more than ``MAX_JSON_CONTAINERS`` arrays and objects,
    a non-finite or unparsed number, an integer of more than ``MAX_INT_DIGITS`` digits, a
    string (or key) with a lone UTF-16 surrogate -- which is also how bytes that were not
    UTF-8 show up after a lossless decode.
    """
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    big = 10**MAX_INT_DIGITS
    containers = 0
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            bad = _SURROGATE.search(item)
            if bad is not None:
                raise ValueError(f"{path or 'job'}: {_surrogate_message(item, bad.start())}")
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not -big < item < big:
                raise ValueError(f"{path or 'job'}: an integer of more than {MAX_INT_DIGITS} digits"
                                 f" (MAX_INT_DIGITS) is not allowed")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(f"{path or 'job'}: {item!r} is not a finite number"
                                 " (NaN and infinities are not allowed)")
        elif isinstance(item, Refused):
            raise ValueError(f"{path or 'job'}: {abbreviate(item)} is {item.why}")
        elif isinstance(item, (dict, list, tuple)):
            if depth > max_depth:
                raise ValueError(f"{path or 'job'}: nested deeper than {max_depth} levels (MAX_JSON_DEPTH)")
            containers += 1
            if containers > MAX_JSON_CONTAINERS:
                raise ValueError(f"job: more than {MAX_JSON_CONTAINERS:,} arrays and objects (MAX_JSON_CONTAINERS)")
            if isinstance(item, dict):
                for key, child in item.items():
                    where = f"{path}.{key}" if path else str(key)
                    if isinstance(key, str) and _SURROGATE.search(key):
                        raise ValueError(f"{path or 'job'}: key {abbreviate(key)}:"
                                         f" {_surrogate_message(key, _SURROGATE.search(key).start())}")
                    stack.append((child, where, depth + 1))
            elif item and set(map(type, item)) == {int} and -big < min(item) and max(item) < big:
                continue  # a list of plain ints in range (token ids): three C-level passes, no Python loop
            else:
                for i, child in enumerate(item):
                    # NOTE: plain ints and strings (token ids, stop lists) are let through here
                    # without a stack entry each: a long list costs one quick pass.
                    if type(child) is int and -big < child < big:
                        continue
                    if type(child) is str and _SURROGATE.search(child) is None:
                        continue
                    stack.append((child, f"{path}.{i}" if path else str(i), depth + 1))


def _surrogate_message(text: str, at: int) -> str:
    code = ord(text[at])
    if 0xDC80 <= code <= 0xDCFF:  # how a lossless decode keeps a byte that was not UTF-8
        return (f"holds the byte 0x{code - 0xDC00:02x} at character {at}, which is not valid UTF-8"
                f" (or the lone surrogate \\u{code:04x}); strings must be valid Unicode")
    return f"holds the lone UTF-16 surrogate \\u{code:04x} at character {at}; strings must be valid Unicode"


def utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (an ASCII string is measured without encoding it)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_size(field: str, size: int, limit: int, name: str, unit: str = "bytes") -> None:
    """``ValueError`` when ``size`` is over ``limit``; ``field`` may be empty when the caller names it."""
    if size > limit:
        where = f"{field} " if field else ""
        raise ValueError(f"{where}{size:,} {unit} is over the limit of {limit:,} ({name})")


def check_sampling_limits(sampling: Any) -> None:
    """The fan-out and stop-list limits, on raw sampling data, before ``SamplingParams`` is built."""
    if not isinstance(sampling, dict):
        return  # the type error is pydantic's to report
    n = sampling.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > MAX_N:
        raise ValueError(f"n: {abbreviate(n)} completions is over the limit of {MAX_N} (MAX_N)")
    stop = sampling.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    check_size("stop:", len(stops), MAX_STOP_STRINGS, "MAX_STOP_STRINGS", "strings")
    for i, s in enumerate(stops):
        if isinstance(s, str) and len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop.{i}: {abbreviate(s)} is {len(s):,} characters;"
                             f" the limit is {MAX_STOP_STRING_CHARS} (MAX_STOP_STRING_CHARS)")
    structured = sampling.get("structured_outputs")
    if isinstance(structured, dict):
        size = utf8_len(json.dumps(structured, ensure_ascii=False, separators=(",", ":"), default=str))
        check_size("structured_outputs:", size, MAX_STRUCTURED_OUTPUTS_BYTES, "MAX_STRUCTURED_OUTPUTS_BYTES",
                   "bytes of JSON")
    for field, limit, name in (("stop_token_ids", MAX_STOP_TOKEN_IDS, "MAX_STOP_TOKEN_IDS"),
                               ("bad_words", MAX_BAD_WORDS, "MAX_BAD_WORDS"),
                               ("logit_bias", MAX_LOGIT_BIAS, "MAX_LOGIT_BIAS"),
                               ("allowed_token_ids", MAX_ALLOWED_TOKEN_IDS, "MAX_ALLOWED_TOKEN_IDS")):
        value = sampling.get(field)
        if isinstance(value, (list, dict)):
            check_size(f"{field}:", len(value), limit, name, "entries")
