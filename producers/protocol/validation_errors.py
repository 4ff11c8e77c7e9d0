"""What a pydantic ``ValidationError`` of a protocol object says to a person: one line naming
each bad field, its value (by its JSON type) and what was expected (``describe_validation_error``),
and the error kind a sampling field's own check raises so that it is named ``sampling.<field>``.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from producers.protocol import limits

_EXPECTED = {"int_type": "an integer", "bool_type": "a boolean", "string_type": "a string", "float_type": "a number",
             "list_type": "an array", "dict_type": "an object", "model_type": "an object",
             "int_from_float": "an integer"}
MAX_ERRORS_NAMED = 5  # a list of a million bad items is reported by its first few


def json_type(value: Any) -> str:
    """The JSON type of a parsed value, for error messages (``the string '5'``)."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    kind = ("a boolean" if isinstance(value, bool) else "the integer" if isinstance(value, int)
            else "the number" if isinstance(value, float) else "the string" if isinstance(value, str)
            else f"a {type(value).__name__}")
    return f"{kind} {limits.abbreviate(value)}"


def sampling_error(field: str, detail: str) -> PydanticCustomError:
    """An error of ``sampling.<field>`` (``describe_validation_error`` names it so); of
    ``<the field validated>.<field>`` wherever it is raised (``tools.3.function.name``)."""
    return PydanticCustomError("sampling_field", "{detail}", {"field": field, "detail": detail})


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming each bad field, its value and what was expected."""
    parts = []
    errors = exc.errors()
    for err in errors[:MAX_ERRORS_NAMED]:
        where = ".".join(str(p) for p in err["loc"])
        kind = err["type"]
        if kind == "sampling_field":
            field = err["ctx"]["field"]
            where = f"{where}.{field}" if field else where
            msg = err["ctx"]["detail"]
        elif kind in _EXPECTED:
            msg = f"expected {_EXPECTED[kind]}, got {json_type(err['input'])}"
        elif kind == "missing":
            msg = "missing"
        elif kind == "extra_forbidden":
            msg = "not a field of this object"
        elif kind == "literal_error":
            msg = f"{err['msg'].removeprefix('Input should be ')} expected, got {json_type(err['input'])}"
        else:
            msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    if len(errors) > MAX_ERRORS_NAMED:
        parts.append(f"and {len(errors) - MAX_ERRORS_NAMED:,} more")
    return "; ".join(parts)
