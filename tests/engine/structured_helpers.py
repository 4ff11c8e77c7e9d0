"""Schemas and validity checks shared by the structured-output tests.

The tiny models' weights are random, so their text is noise: only the constraint can make an
output valid. ``tally`` counts completions that ended on their own (``finish_reason`` "stop"
with no stop string or stop token) and how many of them are valid; a test asks for at least
one and no invalid one, which an unconstrained run fails.
"""

from __future__ import annotations

import json
import re

import jsonschema

GRADE = {
    "type": "object",
    "properties": {
        "score": {"type": "integer", "minimum": 1, "maximum": 10},
        "verdict": {"enum": ["pass", "fail"]},
        "reason": {"type": "string", "maxLength": 12},
    },
    "required": ["score", "verdict", "reason"],
    "additionalProperties": False,
}
FLAG = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}

# a schema whose grammar takes about a second to compile here (xgrammar 0.2.9: 1.2 s on the
# 2-core machine), under the job's 256 KiB bound on structured_outputs (108 KB): 2,000 string
# properties, each with its own pattern. NOTE: an enum of 7,000 strings took 0.16 s with 0.2.9,
# under the tests' 0.25 s limit.
def slow_schema(properties: int) -> dict:
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 11 + 9}}}x{i}"}
                       for i in range(properties)},
    }


SLOW_SCHEMA = slow_schema(2000)
# NOTE: 4.6 s here (xgrammar 0.2.x, 2-core machine; SLOW_SCHEMA 2.1 s): for a time limit of a
# second, long enough for other requests to finish meanwhile on a loaded CI runner
SLOWER_SCHEMA = slow_schema(3000)


def distinct_schema(i: int) -> dict:
    """The ``i``-th of many different small schemas: its own property name and constant."""
    return {
        "type": "object",
        "properties": {f"k{i}": {"const": i}, "v": {"enum": [f"a{i}", f"b{i}"]}},
        "required": [f"k{i}", "v"],
        "additionalProperties": False,
    }


def json_valid(schema: dict):
    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return check


def regex_valid(pattern: str):
    return lambda text: re.fullmatch(pattern, text) is not None


def choice_valid(choices: list[str]):
    return lambda text: text in choices


def ended_by_itself(completion) -> bool:
    """Finished by the end-of-sequence token, which a constraint allows only once complete."""
    return completion.finish_reason == "stop" and completion.stop_reason is None


def tally(outputs, checks) -> tuple[int, list[str]]:
    """(completions that ended by themselves and are valid, texts of those that are not);
    ``checks[i]`` judges ``outputs[i]``."""
    valid, invalid = 0, []
    for output, check in zip(outputs, checks, strict=True):
        for completion in output.outputs:
            if ended_by_itself(completion):
                if check(completion.text):
                    valid += 1
                else:
                    invalid.append(completion.text)
    return valid, invalid


def assert_all_valid(outputs, checks) -> int:
    valid, invalid = tally(outputs, checks)
    assert not invalid, f"completions that ended but break their constraint: {invalid[:3]}"
    assert valid >= 1, "no completion ended by itself: the test proves nothing"
    return valid


def assert_unconstrained_would_fail(outputs, checks) -> None:
    """The same assertions on an unconstrained run fail (so they test the constraint)."""
    valid, invalid = tally(outputs, checks)
    assert invalid or not valid, "an unconstrained run passed the validity checks: they test nothing"
