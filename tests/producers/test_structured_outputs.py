"""``sampling.structured_outputs`` on the producer side: the shapes the protocol takes and
refuses (naming the field), its size limit, and the JSON it travels as in jobs, bulk rows,
Celery kwargs and ``sluiceway submit``, all without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis

from producers.bulk_input import parse_row
from producers.celery_app import generate_signature
from producers.protocol.job import ProtocolError, parse_job
from tests.producers.test_cli import K, invoke

SCHEMA = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10}},
          "required": ["score"]}


def job(structured) -> str:
    return json.dumps({"v": 1, "id": "j1", "prompt": "Hi", "sampling": {"structured_outputs": structured}})


@pytest.mark.parametrize("structured,field", [
    ({"json": SCHEMA}, None),
    ({"json": json.dumps(SCHEMA)}, None),
    ({"regex": "[a-z]+"}, None),
    ({"choice": ["pass", "fail"]}, None),
    ({"grammar": 'root ::= "a"'}, None),
    ({"json_object": True}, None),
    ({}, "sampling.structured_outputs: give exactly one"),
    ({"json": SCHEMA, "regex": "a"}, "sampling.structured_outputs: give exactly one of json, regex, choice, grammar, "
                                     "json_object (got json, regex)"),
    ({"json": {"type": "object", "properties": {"score": {"type": "int"}}}},
     "sampling.structured_outputs.json.properties.score.type: 'int' is not a JSON Schema type"),
    ({"json": {"type": "array", "items": {"type": "string", "maxLength": -1}}},
     "sampling.structured_outputs.json.items.maxLength: expected a non-negative integer, got -1"),
    ({"json": {"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}},
     "sampling.structured_outputs.json.anyOf.1.not: the keyword 'not' is not supported"),
    ({"json": "[1, 2"}, "sampling.structured_outputs.json: not valid JSON"),
    ({"json": [1, 2]}, "sampling.structured_outputs.json: a JSON Schema must be an object"),
    ({"regex": ""}, "sampling.structured_outputs.regex: expected a non-empty string"),
    ({"choice": ["a", 3]}, "sampling.structured_outputs.choice.1: expected a non-empty string, got 3"),
    ({"json_object": False}, "sampling.structured_outputs.json_object: expected true"),
    ({"schema": SCHEMA}, "sampling.structured_outputs.schema: not a structured_outputs field"),
    ("json", "sampling.structured_outputs: expected an object or null, got the string 'json'"),
    ({"json": {"enum": ["x" * 100] * 3000}},
     "sampling.structured_outputs: 309,019 bytes of JSON is over the limit of 262,144 (MAX_STRUCTURED_OUTPUTS_BYTES)"),
])
def test_structured_outputs_shapes(structured, field):
    if field is None:
        parsed = parse_job(job(structured)).sampling["structured_outputs"]
        kind = next(iter(structured))
        assert parsed[kind] == (SCHEMA if kind == "json" else structured[kind])
        return
    with pytest.raises(ProtocolError) as info:
        parse_job(job(structured))
    assert field in str(info.value)


def test_it_cannot_ride_with_ignore_eos():
    with pytest.raises(ProtocolError, match="sampling.structured_outputs: ignore_eos must be false"):
        parse_job(json.dumps({"v": 1, "id": "j1", "prompt": "Hi",
                              "sampling": {"ignore_eos": True, "structured_outputs": {"regex": "a+"}}}))


def test_bulk_rows_and_celery_kwargs_carry_it():
    row = parse_row(0, 1, json.dumps({"prompt": "Hi", "sampling": {"structured_outputs": {"json": SCHEMA}}}).encode(),
                    b"run")
    assert row.error is None and row.job.sampling["structured_outputs"]["json"] == SCHEMA
    bad = parse_row(1, 2, json.dumps({"prompt": "Hi", "sampling": {"structured_outputs": {"choice": []}}}).encode(),
                    b"run")
    assert "line 2" in bad.error and "sampling.structured_outputs.choice" in bad.error
    kwargs = generate_signature(prompt="Hi", sampling={"structured_outputs": {"regex": "[0-9]+"}}).kwargs
    assert json.loads(json.dumps(kwargs))["sampling"]["structured_outputs"]["regex"] == "[0-9]+"


def test_the_protocol_checks_it_without_torch():
    code = ("import json, sys; from producers.protocol.job import parse_job; "
            "parse_job(json.dumps({'v': 1, 'id': 'a', 'prompt': 'x', 'sampling': "
            "{'structured_outputs': {'json': {'type': 'object'}}}})); "
            "assert 'torch' not in sys.modules and 'xgrammar' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sluiceway_submit_carries_it(redis_server):
    res = invoke(redis_server, "submit", "Grade", "--sampling",
                 json.dumps({"max_tokens": 32, "structured_outputs": {"json": SCHEMA}}))
    assert res.exit_code == 0, res.output
    res = invoke(redis_server, "submit", "Pick", "-p", 'structured_outputs={"choice": ["a", "b"]}')
    assert res.exit_code == 0, res.output
    entries = redis.Redis.from_url(redis_server, decode_responses=True).xrange(K.queue("interactive"))
    jobs = [parse_job(fields["job"]) for _, fields in entries]
    assert jobs[0].sampling["structured_outputs"]["json"] == SCHEMA
    assert jobs[1].sampling["structured_outputs"]["choice"] == ["a", "b"]
    res = invoke(redis_server, "submit", "x", "-p", 'structured_outputs={"regex": "a", "choice": ["a"]}')
    assert res.exit_code == 2 and "structured_outputs: give exactly one" in res.output
