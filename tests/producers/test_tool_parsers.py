"""The tool-call parsers on text: whole answers, and the same answers fed as they stream."""

from __future__ import annotations

import json

import pytest

from producers.tool_parsers import Parsed, ParsedCall, new_parser, parse

WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris"}))
TIME = ParsedCall("get_time", json.dumps({"zone": "CET", "exact": True}))
BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BLOCK2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "exact": true}}\n</tool_call>'


@pytest.mark.parametrize("text, parsed", [
    ("Paris is sunny.", Parsed("Paris is sunny.", [])),  # no call: the text as it is
    ("  two spaces, a newline\n", Parsed("  two spaces, a newline\n", [])),
    (BLOCK, Parsed(None, [WEATHER])),
    ("\n" + BLOCK + "\n", Parsed(None, [WEATHER])),  # the template's newlines around it are no content
    ("Let me check.\n" + BLOCK, Parsed("Let me check.\n", [WEATHER])),  # text before the call, as written
    (BLOCK + "\n" + BLOCK2, Parsed(None, [WEATHER, TIME])),  # several calls
    ("First: " + BLOCK + "\nthen " + BLOCK2 + "\nDone.", Parsed("First: \nthen \nDone.", [WEATHER, TIME])),
    ('<tool_call>{"name": "now"}</tool_call>', Parsed(None, [ParsedCall("now", "{}")])),  # no arguments
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments written as a string
     Parsed(None, [ParsedCall("f", '{"a": 1}')])),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', Parsed(None, [WEATHER])),  # left open
    # malformed JSON, or JSON that is no call, stays content as written
    ('Hm <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',
     Parsed('Hm <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>', [])),
    ('<tool_call>["get_weather"]</tool_call> ok', Parsed('<tool_call>["get_weather"]</tool_call> ok', [])),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     Parsed('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [])),
    ("ends open <tool_call>{\"name\": ", Parsed("ends open <tool_call>{\"name\": ", [])),
    ("a bare <tool_ tag", Parsed("a bare <tool_ tag", [])),
    (BLOCK + " and " + '<tool_call>{bad}</tool_call>', Parsed(" and <tool_call>{bad}</tool_call>", [WEATHER])),
    (BLOCK + "\n \n" + '<tool_call>{bad}</tool_call>', Parsed("\n \n<tool_call>{bad}</tool_call>", [WEATHER])),
])
def test_hermes_reads_calls_out_of_the_text(text, parsed):
    assert parse("hermes", text) == parsed


@pytest.mark.parametrize("text, parsed", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', Parsed(None, [WEATHER])),
    (' <|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}', Parsed(None, [WEATHER])),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": '
     '{"zone": "CET", "exact": true}}', Parsed(None, [WEATHER, TIME])),
    ("The weather is fine.", Parsed("The weather is fine.", [])),
    ("Sure: {\"name\": \"get_weather\"}", Parsed("Sure: {\"name\": \"get_weather\"}", [])),  # text first: content
    ('{"name": "get_weather", "parameters": {"city": ', Parsed('{"name": "get_weather", "parameters": {"city": ', [])),
    ('{"city": "Paris"}', Parsed('{"city": "Paris"}', [])),  # JSON, but no call
])
def test_llama3_json_reads_an_answer_of_calls(text, parsed):
    assert parse("llama3_json", text) == parsed


def streamed(name: str, text: str, size: int) -> list:
    parser = new_parser(name)
    pieces = []
    for at in range(0, len(text), size):
        pieces += parser.feed(text[at:at + size])
    return pieces + parser.finish()


@pytest.mark.parametrize("name, text", [
    ("hermes", "Let me check.\n" + BLOCK + "\n" + BLOCK2 + "\nDone."),
    ("hermes", 'Hm <tool_call>{"bad": }</tool_call> and <tool_ more\n\n'),
    ("hermes", "plain text with < and <tool and trailing space  "),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("llama3_json", "  <|py but no tag after all"),
])
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_a_streamed_answer_gives_what_the_whole_one_does(name, text, size):
    pieces = streamed(name, text, size)
    whole = parse(name, text)
    assert [p for p in pieces if isinstance(p, ParsedCall)] == whole.calls
    content = "".join(p for p in pieces if isinstance(p, str))
    assert content == (whole.content or "")
    assert all(p for p in pieces)  # nothing empty is let go


def test_text_before_a_call_streams_before_the_call_is_whole():
    parser = new_parser("hermes")
    assert parser.feed("Let me check") == ["Let me check"]
    assert parser.feed(". <tool_c") == ["."]  # what may begin a call is held back, and the space before it
    assert parser.feed('all>{"name": "get_weather", "arguments": {"city": "Paris"}}') == [" "]
    assert parser.feed("</tool_call>") == [WEATHER]
    assert parser.finish() == []


def test_an_unknown_parser_is_named():
    with pytest.raises(ValueError, match="'mistral' is not a parser \\(they are: hermes, llama3_json\\)"):
        new_parser("mistral")
