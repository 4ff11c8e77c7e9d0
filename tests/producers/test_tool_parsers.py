"""The tool-call parsers on text: whole answers, and the same answers fed as they stream."""

from __future__ import annotations

import json

import pytest

from producers.call_scanner import CallText
from producers.tool_parsers import HERMES_END, HERMES_START, Parsed, ParsedCall, joined_calls, new_parser, parse

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
    # the arguments as the model wrote them, never re-serialized: a stream sent them so
    ('<tool_call>{"arguments": { "a" :[1,  2] }, "name": "f"}</tool_call>',
     Parsed(None, [ParsedCall("f", '{ "a" :[1,  2] }')])),
    # once the name has closed the call has gone out: what follows is its arguments, as written
    ('Hm <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',
     Parsed("Hm ", [ParsedCall("get_weather", '{"city": }')])),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', Parsed(None, [ParsedCall("f", "[1]")])),
    ('cut <tool_call>{"name": "f", "arguments": {"a": "b', Parsed("cut ", [ParsedCall("f", '{"a": "b')])),
    # JSON whose name never closed (or that is no call at all) stays content as written
    ('<tool_call>["get_weather"]</tool_call> ok', Parsed('<tool_call>["get_weather"]</tool_call> ok', [])),
    ('<tool_call>{"name": 7, "arguments": {}}</tool_call>',
     Parsed('<tool_call>{"name": 7, "arguments": {}}</tool_call>', [])),
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
    ('{"name": "get_weather", "parameters": {"city": ', Parsed(None, [ParsedCall("get_weather", '{"city": ')])),  # cut
    ('{"city": "Paris"}', Parsed('{"city": "Paris"}', [])),  # JSON, but no call
    ('{"name": "get_wea', Parsed('{"name": "get_wea', [])),  # cut before its name closed
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
    assert joined_calls(p for p in pieces if isinstance(p, CallText)) == whole.calls
    content = "".join(p for p in pieces if isinstance(p, str))
    assert content == (whole.content or "")
    assert all(p for p in pieces)  # nothing empty is let go


def test_text_before_a_call_streams_before_the_call_is_whole():
    parser = new_parser("hermes")
    assert parser.feed("Let me check") == ["Let me check"]
    assert parser.feed(". <tool_c") == ["."]  # what may begin a call is held back, and the space before it
    assert parser.feed('all>{"name": "get_weather", "arguments": {"city": "Paris"}}') == [
        " ", CallText(0, "get_weather", '{"city": "Paris"}')]
    assert parser.feed("</tool_call>") == []
    assert parser.finish() == []


def test_an_unknown_parser_is_named():
    with pytest.raises(ValueError, match="'mistral' is not a parser \\(they are: hermes, llama3_json\\)"):
        new_parser("mistral")


# text with '<' that is no tag (and a tag's beginning that is none), a call whose arguments hold
# '<', '</tool' and quotes, whitespace as written, a call without arguments, a block that is no call
HERMES_TEXT = ('Is 1 < 2? <b>Yes</b>, <tool_ is no tag.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Pa<ris", "note": "a </tool \\"quoted\\" <tool_call",  "n": [1, {"x": null}]}}\n'
               '</tool_call>\n<tool_call>{"name": "get_time"}</tool_call> then <tool_call>{bad}</tool_call> done')
HERMES_ARGUMENTS = '{"city": "Pa<ris", "note": "a </tool \\"quoted\\" <tool_call",  "n": [1, {"x": null}]}'
HERMES_WHOLE = Parsed("Is 1 < 2? <b>Yes</b>, <tool_ is no tag.\n then <tool_call>{bad}</tool_call> done",
                      [ParsedCall("get_weather", HERMES_ARGUMENTS), ParsedCall("get_time", "{}")])
LLAMA_TEXT = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris",  "unit": "c;}"}} ; '
              '{"parameters": {"zone": "CET"}, "name": "get_time"}')
LLAMA_WHOLE = Parsed(None, [ParsedCall("get_weather", '{"city": "Paris",  "unit": "c;}"}'),
                            ParsedCall("get_time", '{"zone": "CET"}')])


def sent(name: str, *parts: str) -> tuple[str, list[CallText]]:
    """What feeding ``parts`` lets go, before ``finish``: the content joined, and the call pieces."""
    parser = new_parser(name)
    pieces = [piece for part in parts for piece in parser.feed(part)]
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, CallText)]


def opened_in_order(pieces: list[CallText]) -> None:
    """Each call opens once, with its name, before any fragment of it, in call order; no fragment is empty."""
    seen: set[int] = set()
    for piece in pieces:
        if piece.name is not None:
            assert piece.index == len(seen), pieces
            seen.add(piece.index)
        else:
            assert piece.index in seen and piece.arguments, pieces


def split_at(name: str, text: str, cut: int) -> list:
    parser = new_parser(name)
    return parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()


@pytest.mark.parametrize("name, text, whole", [("hermes", HERMES_TEXT, HERMES_WHOLE),
                                               ("llama3_json", LLAMA_TEXT, LLAMA_WHOLE)])
def test_an_answer_split_at_any_character_gives_the_whole_answers_content_and_calls(name, text, whole):
    assert parse(name, text) == whole
    # a split inside tags, names, keys, strings, escapes and the text around them; a character at a time
    for pieces in [*(split_at(name, text, cut) for cut in range(len(text) + 1)), streamed(name, text, 1)]:
        opened_in_order([p for p in pieces if isinstance(p, CallText)])
        assert joined_calls(p for p in pieces if isinstance(p, CallText)) == whole.calls, pieces
        assert "".join(p for p in pieces if isinstance(p, str)) == (whole.content or ""), pieces


def test_hermes_holds_back_no_more_than_a_tags_beginning_and_sends_arguments_as_they_come():
    first_block = HERMES_TEXT.index(HERMES_START)
    name_closed = HERMES_TEXT.index('"get_weather"') + len('"get_weather"')
    arguments_at = HERMES_TEXT.index(HERMES_ARGUMENTS)
    for cut in range(len(HERMES_TEXT.split(HERMES_END)[0]) + 1):
        head = HERMES_TEXT[:cut]
        content, pieces = sent("hermes", head)
        if cut < first_block + len(HERMES_START):  # text: all of it but trailing whitespace and a tag's beginning
            held = head[len(content):]
            assert head.startswith(content) and HERMES_START.startswith(held.lstrip()) and not pieces, head
            continue
        assert content == HERMES_TEXT[:first_block] and bool(pieces) == (cut >= name_closed), head
        if cut < name_closed:
            continue
        assert (pieces[0].index, pieces[0].name) == (0, "get_weather")
        arguments = "".join(p.arguments for p in pieces)
        written = HERMES_ARGUMENTS[:max(0, cut - arguments_at)]
        # every character of the arguments so far went out, but what may begin the end tag
        assert written.startswith(arguments) and HERMES_END.startswith(written[len(arguments):]), head


def test_llama3_json_sends_a_call_once_its_name_has_closed_then_its_arguments_as_they_come():
    name_closed = LLAMA_TEXT.index('"get_weather"') + len('"get_weather"')
    arguments = LLAMA_WHOLE.calls[0].arguments
    arguments_at = LLAMA_TEXT.index(arguments)
    for cut in range(arguments_at + len(arguments) + 1):
        content, pieces = sent("llama3_json", LLAMA_TEXT[:cut])
        assert content == ""  # an answer that opens as calls sends no content
        if cut < name_closed:
            assert pieces == [], LLAMA_TEXT[:cut]
            continue
        assert pieces[0].name == "get_weather"
        assert "".join(p.arguments for p in pieces) == arguments[:max(0, cut - arguments_at)], LLAMA_TEXT[:cut]
    # no call's name ever closed: content, at the end
    parser = new_parser("llama3_json")
    assert parser.feed('{"city": ') == [] and parser.feed('"Paris"}') == [] and parser.finish() == ['{"city": "Paris"}']
