"""The JSON types of a job's ``sampling`` fields, checked before ``SamplingParams`` reads them: a
wrong type is a ``ProtocolError`` naming the field (``sampling.top_p``), never a crash inside it."""

from __future__ import annotations

import typing
from typing import Any

from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputsParams
from producers.protocol import limits
from producers.protocol.limits import abbreviate
from producers.protocol.validation_errors import json_type, sampling_error


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_token_key(k: Any) -> bool:
    """A token id as an object key: an integer, or its decimal digits as JSON spells it.

    NOTE: ASCII digits only, at most ``MAX_INT_DIGITS``: ``str.isdigit`` also passes '²' (which
    ``int`` refuses), '١' (which it reads as 1) and 5,000 digits (past ``int``'s own limit)."""
    return _is_int(k) or isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= limits.MAX_INT_DIGITS


_JSON_CHECKS: dict[Any, tuple[Any, str]] = {
    int: (_is_int, "an integer"),
    float: (_is_number, "a number"),
    bool: (lambda v: isinstance(v, bool), "a boolean"),
    str: (lambda v: isinstance(v, str), "a string"),
    # NOTE: a stop list may also be one string (vLLM's and OpenAI's spelling); null is a list's default.
    # (A tuple, from a Python caller, is an array too.)
    list[str]: (lambda v: v is None or isinstance(v, str)
                or isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v),
                "a string or an array of strings"),
    list[int]: (lambda v: v is None or isinstance(v, (list, tuple)) and all(_is_int(t) for t in v),
                "an array of integers"),
    # NOTE: JSON object keys are strings: a token id key is its decimal digits
    dict[int, float]: (lambda v: v is None or isinstance(v, dict) and all(
        _is_token_key(k) and _is_number(x) for k, x in v.items()), "an object of token ids to numbers"),
    dict[str, Any]: (lambda v: isinstance(v, dict), "an object"),
    StructuredOutputsParams: (lambda v: isinstance(v, (dict, StructuredOutputsParams)), "an object"),
}


def _sampling_checks() -> dict[str, tuple[Any, str]]:
    """Each ``SamplingParams`` field's JSON type check, from its annotation (``X | None`` allows null).

    A field whose type has no JSON spelling here is left to ``SamplingParams`` itself.
    """
    checks = {}
    for name, hint in typing.get_type_hints(SamplingParams).items():
        args = typing.get_args(hint)
        optional = type(None) in args and len(args) == 2
        base = next(a for a in args if a is not type(None)) if optional else hint
        if base in _JSON_CHECKS:
            test, expected = _JSON_CHECKS[base]
            if optional:
                test, expected = (lambda v, t=test: v is None or t(v)), f"{expected} or null"
            checks[name] = (test, expected)
        else:
            checks[name] = (lambda v: True, "")
    return checks


SAMPLING_CHECKS = _sampling_checks()


def check_sampling_types(sampling: dict[str, Any]) -> None:
    """Every ``sampling`` field known and of its exact JSON type; the error names ``sampling.<field>``."""
    for name, value in sampling.items():
        check = SAMPLING_CHECKS.get(name)
        if check is None:
            raise sampling_error(str(name), f"not a sampling field (they are: {', '.join(SAMPLING_CHECKS)})")
        test, expected = check
        if test(value):
            continue
        if isinstance(value, (list, tuple)) and "array of " in expected:  # name the first bad item
            item_test, item = (_is_int, "an integer") if "integers" in expected else (_is_str, "a string")
            index = next(i for i, v in enumerate(value) if not item_test(v))
            raise sampling_error(f"{name}.{index}", f"expected {item}, got {json_type(value[index])}")
        if isinstance(value, dict) and "token ids to numbers" in expected:  # name the first bad key or value
            key, item = next((k, x) for k, x in value.items() if not (_is_token_key(k) and _is_number(x)))
            if not _is_token_key(key):
                raise sampling_error(name, f"key {abbreviate(key)} is not a token id: expected 1 to "
                                           f"{limits.MAX_INT_DIGITS} decimal digits 0-9 (MAX_INT_DIGITS)")
            raise sampling_error(f"{name}.{key}", f"expected a number, got {json_type(item)}")
        raise sampling_error(name, f"expected {expected}, got {json_type(value)}")
