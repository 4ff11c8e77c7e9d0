"""The incremental reader of a required tool choice's answer (producers/call_scanner.py)."""

from __future__ import annotations

import json

import pytest

from producers.call_scanner import CallScanner, CallText

# strings holding quotes, backslashes, brackets, braces and escapes; nesting; every scalar; the
# whitespace constrained decoding may put anywhere
SAMPLE = ('[ {"name": "get_weather", "parameters": {"city": "Pa\\"ris]}", "path": "C:\\\\}{\\\\",'
          ' "tags": ["[", "{\\"a\\": 1}", {"deep": [[], {}]}], "n": -1.5e3, "ok": true, "x": null,'
          ' "esc": "\\u00e9\\n\\t\\/", "raw": "Zürich ☂"} } ,\n'
          ' {"name":"get_t\\u0069me","parameters":{ "zone" :"UTC" }}]')
EXPECTED = [("get_weather", SAMPLE[SAMPLE.index('{"city"'):SAMPLE.index('} }') + 1]),
            ("get_time", '{ "zone" :"UTC" }')]


def joined(pieces: list[CallText]) -> list[tuple[str, str]]:
    """Each call's name and joined arguments, checking what a stream needs of the pieces: each
    call opens once, with its name, before any fragment of it, and no fragment is empty."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        if piece.name is not None:
            assert piece.index not in calls and piece.index == len(calls), pieces
            calls[piece.index] = [piece.name, piece.arguments]
        else:
            assert piece.index in calls and piece.arguments, pieces
            calls[piece.index][1] += piece.arguments
    return [(name, arguments) for name, arguments in calls.values()]


def fed(*parts: str) -> list[CallText]:
    scanner = CallScanner()
    return [piece for part in parts for piece in scanner.feed(part)]


def test_a_whole_answer_gives_each_calls_name_and_its_parameters_text_as_written():
    assert joined(fed(SAMPLE)) == EXPECTED
    value = json.loads(SAMPLE)
    assert [json.loads(arguments) for _, arguments in EXPECTED] == [call["parameters"] for call in value]


def test_an_answer_split_at_any_character_gives_the_same_calls():
    for cut in range(len(SAMPLE) + 1):  # inside keys, names, escapes, \u escapes and whitespace among them
        assert joined(fed(SAMPLE[:cut], SAMPLE[cut:])) == EXPECTED, SAMPLE[:cut]


def test_an_answer_fed_a_character_at_a_time_sends_each_character_once_as_it_comes():
    scanner = CallScanner()
    pieces = []
    for i, ch in enumerate(SAMPLE):
        got = scanner.feed(ch)
        pieces += got
        if i == SAMPLE.index('"get_weather"') + len('"get_weather"') - 1:  # the name's closing quote
            assert got == [CallText(0, "get_weather", "")]
    assert joined(pieces) == EXPECTED
    assert len([p for p in pieces if p.index == 0]) == len(EXPECTED[0][1]) + 1  # the opening, then a piece each


def test_parameters_before_the_name_are_held_until_it_comes():
    scanner = CallScanner()
    assert scanner.feed('[{"parameters": {"a": "\\"name\\": 1"}, ') == []
    assert scanner.feed('"name": "f"}]') == [CallText(0, "f", '{"a": "\\"name\\": 1"}')]


def test_only_a_calls_own_name_and_parameters_are_read():
    # a name or parameters key inside the arguments is the arguments' text; other keys are skipped
    text = '[{"id": {"name": "no"}, "name": "f", "extra": [1, "]"], "parameters": {"name": "g", "parameters": []}}]'
    assert joined(fed(text)) == [("f", '{"name": "g", "parameters": []}')]


@pytest.mark.parametrize("text", [
    '{"name": "f", "parameters": {}}',  # no array: no calls
    '[["name", "f"], 3, "x"]',  # items that are no objects
    '[{"name": 7, "parameters": {}}]',  # a name that is no string
])
def test_text_of_another_shape_sends_nothing(text):
    assert fed(text) == []


def test_a_cut_answer_sends_what_it_has():
    assert joined(fed('[{"name": "f", "parameters": {"a": [1, "x\\')) == [("f", '{"a": [1, "x\\')]
    assert fed('[{"name": "f') == []


# calls written one object after another (a hermes block, llama3_json's ';'-separated answer): the
# arguments under either key, written as a string or left out; an object or a name that is no call
OBJECTS = ('{"name": "get_weather", "arguments": {"city": "Oslo;{"}} ; {"x": {"name": "no"}} ;'
           ' {"parameters": "{\\"zone\\": \\"CET\\"}", "name": "get_time"}; {"name": ""}; {"name": "now"}')
OBJECTS_EXPECTED = [("get_weather", '{"city": "Oslo;{"}'), ("get_time", '{"zone": "CET"}'), ("now", "{}")]


def test_objects_one_after_another_are_calls_numbered_in_order_split_anywhere():
    for cut in range(len(OBJECTS) + 1):
        scanner = CallScanner(array=False, arguments=("arguments", "parameters"))
        pieces = scanner.feed(OBJECTS[:cut]) + scanner.feed(OBJECTS[cut:])
        assert joined(pieces) == OBJECTS_EXPECTED, OBJECTS[:cut]


def test_arguments_written_as_a_string_go_out_decoded_once_it_closes():
    scanner = CallScanner(array=False, arguments=("arguments",))
    assert scanner.feed('{"name": "f", "arguments": "{\\"a\\"') == [CallText(0, "f", "")]
    assert scanner.feed(': 1}"') == [CallText(0, None, '{"a": 1}')]
    assert scanner.feed("}") == []
