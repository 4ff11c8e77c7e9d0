"""The protocol's limits: ``parse_job`` raises only ``ProtocolError`` whatever the bytes, reads the id
whenever it can, and names the field and the limit; ``make_job`` refuses the same jobs before
they are enqueued."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from producers.protocol import limits
from producers.errors import InvalidJob
from producers.jobs import make_job
from producers.protocol import ProtocolError, parse_job

DOC = (Path(__file__).resolve().parents[2] / "PROTOCOL.md").read_text()


def refused(raw: bytes | str) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_job(raw)
    return info.value


def with_prompt(fields: dict) -> dict:
    """``fields``, with a prompt added when they give none."""
    return fields if {"prompt", "prompt_token_ids", "messages"} & set(fields) else {"prompt": "x", **fields}


def entry(ensure_ascii: bool = True, **fields) -> str:
    return json.dumps({"v": 1, "id": "j-1", **with_prompt(fields)}, ensure_ascii=ensure_ascii)


HOSTILE = [
    b'{"v": 1, "id": "deep", "prompt": "x", "metadata": {"a": ' + b"[" * 1000 + b"]" * 1000 + b"}}",
    b'{"v": 1, "id": "deep", "metadata": ' + b"{" * 100_000,
    b"[" * 100_000,
    b'{"v": 1, "id": "deep", "metadata": {"a": ' + b"9" * 5000 + b"}}",
    b'{"v": 1, "id": "deep", "prompt": "\xff\xfe\xc3"}',
    b'{"v": 1, "id": "deep", "prompt": "x", "metadata": {"\\udfff": 1}}',
    b'{"v": 1, "id": "deep", "prompt": "x", "deadline": -Infinity}',
    b'{"v": 1, "id": "deep", "prompt": "x", "metadata": {"a": [' + b"[]," * 20_000 + b"[]]}}",
    b'{"v": 1, "id": "deep", "prompt": "x", "metadata": {"n": 1e999}}',
    b'{"v": 1, "id": "deep", "prompt": "x", "metadata": {"x": 1e' + b"9" * 300 + b"}}",
]


@pytest.mark.parametrize("raw", HOSTILE, ids=range(len(HOSTILE)))
def test_any_bytes_give_a_protocol_error_and_the_id_when_it_can_be_read(raw):
    error = refused(raw)
    assert error.job_id == ("deep" if raw.startswith(b'{"v": 1, "id": "deep"') else None)


def test_nesting_is_bounded_and_checked_without_recursion():
    at_limit = '{"v": 1, "id": "j-1", "prompt": "x", "metadata": {"a": %s%s}}' % (
        "[" * (limits.MAX_JSON_DEPTH - 2), "]" * (limits.MAX_JSON_DEPTH - 2))
    assert parse_job(at_limit).metadata["a"] is not None
    error = refused(at_limit.replace('"a": [', '"a": [['). replace("]}}", "]]}}"))
    assert error.job_id == "j-1" and str(error) == "job: nested deeper than 32 levels (MAX_JSON_DEPTH)"
    assert refused('{"v": 1, "id": "j-1", "prompt": "x", "metadata": {"a": %s' % ("[" * 100_000)).job_id == "j-1"


def test_the_id_of_an_unparsable_entry_is_read_only_at_the_top_level():
    assert refused(b'{"v": 1, "id": "broken-1", "prompt": "x",').job_id == "broken-1"
    assert refused(b'{"v": 1, "metadata": {"id": "someone-else"}, "prompt": "x",').job_id is None
    assert refused(b'{"v": 1, "prompt": "\\"id\\": \\"no\\"", "x": ').job_id is None


def test_bad_utf8_and_lone_surrogates_are_errors_of_the_string_that_holds_them():
    error = refused(b'{"v": 1, "id": "j-1", "prompt": "ok", "metadata": {"note": "caf\xe9"}}')
    assert error.job_id == "j-1" and str(error).startswith("metadata.note:") and "0xe9" in str(error)
    for place, raw in [("prompt", entry(prompt="\ud83d")),
                       ("messages.0.content", entry(messages=[{"role": "user", "content": "a\udc00"}])),
                       ("sampling.stop.0", entry(sampling={"stop": ["\ud800"]})),
                       ("metadata.tags.1", entry(metadata={"tags": ["ok", "\ud800 cut"]}))]:
        error = refused(raw)  # json.dumps writes the surrogate as an escape, as JavaScript does
        assert error.job_id == "j-1" and str(error).startswith(f"{place}:") and "lone UTF-16 surrogate" in str(error)


@pytest.mark.parametrize("literal,field", [("NaN", "deadline"), ("Infinity", "deadline"), ("1e999", "deadline"),
                                           ("NaN", "metadata.score"), ("-1e400", "metadata.score")])
def test_non_finite_numbers_are_refused_in_any_field(literal, field):
    if field == "deadline":
        raw = '{"v": 1, "id": "j-1", "prompt": "x", "deadline": %s}' % literal
    else:
        raw = '{"v": 1, "id": "j-1", "prompt": "x", "metadata": {"score": %s}}' % literal
    error = refused(raw)
    assert error.job_id == "j-1" and str(error).startswith(f"{field}: {literal} is") and "finite" in str(error)


def test_integers_past_the_digit_limit_are_a_field_error():
    ok = "9" * limits.MAX_INT_DIGITS
    assert parse_job('{"v": 1, "id": "j-1", "prompt": "x", "metadata": {"n": %s}}' % ok).metadata["n"] == int(ok)
    error = refused('{"v": 1, "id": "j-1", "prompt": "x", "metadata": {"n": -%s}}' % ("1" * 5000))
    assert error.job_id == "j-1" and str(error).startswith("metadata.n: -1111")
    assert "5,000 digits; the limit is 64 (MAX_INT_DIGITS)" in str(error) and len(str(error)) < 300
    # one digit past the limit, inside a list of token ids that are fine: named by its index
    ids = ", ".join(["7"] * 40 + ["1" * (limits.MAX_INT_DIGITS + 1)] + ["8"] * 3)
    error = refused('{"v": 1, "id": "j-2", "prompt_token_ids": [%s]}' % ids)
    assert str(error).startswith("prompt_token_ids.40: 1111") and "65 digits" in str(error)
    error = refused('{"v": 1, "id": "j-3", "prompt_token_ids": [1, 2, -3]}')
    assert "prompt_token_ids" in str(error) and "non-negative" in str(error)


def test_long_digit_runs_are_found_exactly_at_the_limit():
    n = limits.MAX_INT_DIGITS
    assert not limits.has_long_digit_run("[" + ", ".join(["9" * n] * 50) + "]")
    assert limits.has_long_digit_run('{"a": [1, %s]}' % ("9" * (n + 1)))
    assert not limits.has_long_digit_run("1" * n + "\u0661" * 10 + "2" * n)  # another script's digits break a run
    assert limits.has_long_digit_run("x" * 1000 + "5" * (n + 1))


def test_an_entry_over_the_byte_limit_is_refused_unparsed_with_its_id():
    raw = '{"v": 1, "id": "big-1", "prompt": "%s"}' % ("a" * limits.MAX_ENTRY_BYTES)
    error = refused(raw.encode())
    assert error.job_id == "big-1" and "MAX_ENTRY_BYTES" in str(error) and f"{len(raw):,} bytes" in str(error)


def past_each_limit() -> list[tuple[dict, str]]:
    """(job fields just past one limit, the limit's name) -- and the same fields at the limit parse."""
    L = limits
    return [
        (dict(sampling={"n": L.MAX_N + 1}), "MAX_N"),
        (dict(prompt="é" * (L.MAX_PROMPT_BYTES // 2) + "a"), "MAX_PROMPT_BYTES"),
        (dict(prompt_token_ids=[3] * (L.MAX_PROMPT_TOKEN_IDS + 1)), "MAX_PROMPT_TOKEN_IDS"),
        (dict(messages=[{"role": "user", "content": "hi"}] * (L.MAX_MESSAGES + 1)), "MAX_MESSAGES"),
        (dict(messages=[{"role": "user", "content": "a" * (L.MAX_PROMPT_BYTES // 2)}] * 2
              + [{"role": "user", "content": "b"}]), "MAX_PROMPT_BYTES"),
        (dict(sampling={"stop": ["s"] * (L.MAX_STOP_STRINGS + 1)}), "MAX_STOP_STRINGS"),
        (dict(sampling={"stop": "s" * (L.MAX_STOP_STRING_CHARS + 1)}), "MAX_STOP_STRING_CHARS"),
        (dict(sampling={"stop_token_ids": [2] * (L.MAX_STOP_TOKEN_IDS + 1)}), "MAX_STOP_TOKEN_IDS"),
        (dict(sampling={"bad_words": ["w"] * (L.MAX_BAD_WORDS + 1)}), "MAX_BAD_WORDS"),
        (dict(sampling={"logit_bias": {str(t): 1.0 for t in range(L.MAX_LOGIT_BIAS + 1)}}), "MAX_LOGIT_BIAS"),
        (dict(sampling={"allowed_token_ids": [2] * (L.MAX_ALLOWED_TOKEN_IDS + 1)}), "MAX_ALLOWED_TOKEN_IDS"),
        (dict(metadata={"m": "x" * (L.MAX_METADATA_BYTES - 7)}), "MAX_METADATA_BYTES"),
    ]


def at_the_limit(fields: dict) -> dict:
    """The same fields, one unit smaller: exactly at the limit."""
    out = json.loads(json.dumps(fields))
    if "sampling" in out:
        key, value = next(iter(out["sampling"].items()))
        if isinstance(value, dict):
            out["sampling"][key] = dict(list(value.items())[:-1])
        else:
            out["sampling"][key] = value - 1 if isinstance(value, int) else value[:-1]
    elif "prompt" in out:
        out["prompt"] = out["prompt"][:-1]
    elif "prompt_token_ids" in out:
        out["prompt_token_ids"].pop()
    elif "messages" in out:
        out["messages"].pop()
    else:
        out["metadata"]["m"] = out["metadata"]["m"][:-1]
    return out


@pytest.mark.parametrize("fields,name", past_each_limit(), ids=[n for _, n in past_each_limit()])
def test_each_limit_is_enforced_by_the_worker_and_the_client_alike(fields, name):
    error = refused(entry(ensure_ascii=False, **fields).encode())
    assert error.job_id == "j-1" and f"({name})" in str(error) and len(str(error)) < 400, str(error)
    with pytest.raises(InvalidJob, match=re.escape(f"({name})")):
        make_job(**with_prompt(fields))
    parse_job(entry(ensure_ascii=False, **at_the_limit(fields)).encode())
    make_job(**with_prompt(at_the_limit(fields)))


def test_make_job_refuses_non_finite_deadlines_surrogates_and_deep_metadata():
    for deadline in (math.nan, math.inf, -math.inf):
        with pytest.raises(InvalidJob, match="deadline.*finite"):
            make_job("x", deadline=deadline)
    with pytest.raises(InvalidJob, match="lone UTF-16 surrogate"):
        make_job("cut \ud83d")
    with pytest.raises(InvalidJob, match="metadata.score.*finite"):
        make_job("x", metadata={"score": math.nan})
    deep: list = []
    for _ in range(2000):
        deep = [deep]
    with pytest.raises(InvalidJob, match="MAX_JSON_DEPTH"):
        make_job("x", metadata={"deep": deep})


def test_the_container_count_and_the_escaped_entry_size_are_bounded_on_both_sides():
    # The job, its sampling, its metadata and the list are 4 more: 4 too many, then just at the limit.
    many = {"rows": [{} for _ in range(limits.MAX_JSON_CONTAINERS)]}
    with pytest.raises(InvalidJob, match=re.escape("more than 10,000 arrays and objects (MAX_JSON_CONTAINERS)")):
        make_job("x", metadata=many)
    assert "(MAX_JSON_CONTAINERS)" in str(refused(entry(metadata=many)))
    at_limit = {"rows": [{} for _ in range(limits.MAX_JSON_CONTAINERS - 4)]}
    make_job("x", metadata=at_limit)
    parse_job(entry(metadata=at_limit))
    escaped = "\x01" * limits.MAX_PROMPT_BYTES  # under the prompt limit, but 6 bytes each once escaped in JSON
    with pytest.raises(InvalidJob, match=re.escape("(MAX_ENTRY_BYTES)")):
        make_job(escaped)
    assert "(MAX_ENTRY_BYTES)" in str(refused(entry(prompt=escaped)))


def test_protocol_md_lists_every_limit_with_its_value():
    for name, value in limits.LIMITS.items():
        assert re.search(rf"`{name}`\s*\|\s*{value:,}\b", DOC), f"PROTOCOL.md does not list {name} = {value:,}"


def test_structure_is_checked_exactly_at_the_limits_brackets_in_strings_not_counted():
    depth = limits.MAX_JSON_DEPTH
    assert limits.structure_problem("[" * depth + "]" * depth) is None
    assert "MAX_JSON_DEPTH" in limits.structure_problem("[" * (depth + 1) + "]" * (depth + 1))
    assert limits.structure_problem('{"a": "' + "[{" * 100 + '"}') is None  # the full pass ran: strings blanked
