"""What a request's output must look like: a JSON schema, a regex, a choice or a grammar.

Torch-free on purpose, like ``engine.sampling_params``: the protocol in ``producers`` builds
these to reject a bad constraint before it is queued. Only the shape is checked here; the
engine compiles the constraint (``engine/structured/``) and refuses what its backend cannot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FIELDS = ("json", "regex", "choice", "grammar", "json_object")
_PLACE = "structured_outputs"

# NOTE: keywords the grammar backend (xgrammar 0.2) accepts but does not enforce (checked by
# comparing its grammars with and without each): a schema using one would be promised and
# not kept, so it is refused instead.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
    "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
    "unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$dynamicAnchor",
})
_TYPES = frozenset({"null", "boolean", "object", "array", "number", "integer", "string"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")  # [schema, ...]
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems")  # schema (or bool)
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_DATA = ("enum", "const", "default", "examples", "description", "title", "$comment")  # not schemas


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint on a request's output (vLLM's names).

    ``json``: a JSON Schema (an object, or a string holding one); ``regex``: a regular
    expression the whole output matches; ``choice``: the output is one of these strings;
    ``grammar``: an EBNF grammar (GBNF style, with a ``root`` rule); ``json_object``: any
    JSON object. The output ends, with an end-of-sequence token, when the constraint is
    complete; ``finish_reason`` "stop" then means the output satisfies it.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"{_PLACE}: give exactly one of {', '.join(FIELDS)} (got {', '.join(given) or 'none'})")
        if self.json is not None:
            self.json = _parse_schema(self.json)
            check_schema(self.json, f"{_PLACE}.json")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{_PLACE}.{name}: expected a non-empty string, got {_short(value)}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"{_PLACE}.choice: expected a non-empty list of strings, got {_short(self.choice)}")
            self.choice = list(self.choice)
            for i, c in enumerate(self.choice):
                if not isinstance(c, str) or not c:
                    raise ValueError(f"{_PLACE}.choice.{i}: expected a non-empty string, got {_short(c)}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"{_PLACE}.json_object: expected true (or leave it out), got {_short(self.json_object)}")

    @property
    def kind(self) -> str:
        """The one field that is set."""
        return next(name for name in FIELDS if getattr(self, name) is not None)

    @property
    def key(self) -> str:
        """A canonical text of the constraint: equal constraints share one compiled grammar."""
        value = getattr(self, self.kind)
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_value(cls, value: "StructuredOutputsParams | dict[str, Any] | None") -> "StructuredOutputsParams | None":
        """Accept an instance, its JSON form (unknown keys raise naming them) or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{_PLACE}: expected an object, got {_short(value)}")
        unknown = sorted(set(value) - set(FIELDS))
        if unknown:
            raise ValueError(f"{_PLACE}.{unknown[0]}: not a structured_outputs field (they are: {', '.join(FIELDS)})")
        return cls(**value)


def _parse_schema(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{_PLACE}.json: not valid JSON ({exc}): {_short(value)}") from None
    if isinstance(value, bool) or not isinstance(value, dict):
        raise ValueError(f"{_PLACE}.json: a JSON Schema must be an object, got {_short(value)}")
    return value


def check_schema(schema: Any, place: str) -> None:
    """Refuse a schema whose keywords have the wrong shape or that the backend cannot enforce.

    A light walk, not a full meta-schema validation: types, the keywords that hold schemas,
    counts and bounds. The place of the first problem is named (``...json.properties.score``).
    """
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{place}: a schema must be an object or a boolean, got {_short(schema)}")
    for key, value in schema.items():
        where = f"{place}.{key}"
        if key in UNSUPPORTED_KEYWORDS:
            raise ValueError(f"{where}: the keyword {key!r} is not supported in structured outputs")
        if key == "type":
            names = value if isinstance(value, list) else [value]
            bad = next((t for t in names if not isinstance(t, str) or t not in _TYPES), None)
            if bad is not None or not names:
                raise ValueError(f"{where}: {_short(bad)} is not a JSON Schema type ({', '.join(sorted(_TYPES))})")
        elif key in _SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise ValueError(f"{where}: expected an object of schemas, got {_short(value)}")
            for name, sub in value.items():
                check_schema(sub, f"{where}.{name}")
        elif key in _SCHEMA_LISTS:
            if not isinstance(value, list) or not value:
                raise ValueError(f"{where}: expected a non-empty array of schemas, got {_short(value)}")
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}.{i}")
        elif key in _SCHEMA_ONE:
            check_schema(value, where)
        elif key == "required":
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                raise ValueError(f"{where}: expected an array of property names, got {_short(value)}")
        elif key == "enum":
            if not isinstance(value, list) or not value:
                raise ValueError(f"{where}: expected a non-empty array, got {_short(value)}")
        elif key in _COUNTS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: expected a non-negative integer, got {_short(value)}")
        elif key in _NUMBERS:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}: expected a number, got {_short(value)}")
        elif key == "pattern" and not isinstance(value, str):
            raise ValueError(f"{where}: expected a regular expression string, got {_short(value)}")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
