"""Tool-call parsers: a model's answer -> its content and the tool calls written in it.

What vLLM's ``--tool-call-parser`` names, for answers whose request left the choice to the model
(``tool_choice`` "auto"):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the
  text (Hermes 2 Pro and later, Qwen2.5, Qwen3); the text around them is the content.
- ``llama3_json``: an answer that is one JSON object ``{"name": ..., "parameters": {...}}``, or
  several separated by ``;``, after an optional ``<|python_tag|>`` (Llama 3.1 to 3.3's JSON tool
  calling); any other answer is content.

Each parser reads text as it streams (``feed`` each delta, then ``finish``) and says what can be
sent: content, held back only while it may still begin a call, and each call once it is whole.
A whole answer is read the same way (``parse``), so a streamed answer joins to the whole one.
A call that is not JSON of that shape stays content. Pure Python: the gateway runs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedCall:
    """One call the model wrote: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


Piece = str | ParsedCall  # what a parser lets go: content text, or a whole call


@dataclass(frozen=True)
class Parsed:
    """A whole answer, read: the content (None when the calls leave none) and the calls."""

    content: str | None
    calls: list[ParsedCall]


def call_of(value: Any) -> ParsedCall | None:
    """``{"name": ..., "arguments" (or "parameters"): {...}}`` as a call, or None.

    Arguments given as a string holding a JSON object (as some models write them) are taken;
    none at all is a call without arguments."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _json_call(text: str) -> ParsedCall | None:
    try:
        return call_of(json.loads(text))
    except ValueError:
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesParser:
    """``<tool_call>`` blocks. Text outside them is content as written, but a stretch of it that
    is only whitespace (the newlines a template puts around a block) is not: whitespace is held
    back until the text after it shows which it is."""

    def __init__(self) -> None:
        self.buffer = ""  # text not read yet: what may begin a block, or an open block's body
        self.in_call = False  # inside a block
        self.spaces = ""  # whitespace held back
        self.has_text = False  # the stretch since the last block holds more than whitespace
        self.before = ""  # the whitespace dropped before the open block (content again if it is no call)
        self.called = False

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while True:
            if self.in_call:
                end = self.buffer.find(HERMES_END)
                if end < 0:
                    return out
                body, self.buffer = self.buffer[:end], self.buffer[end + len(HERMES_END):]
                self._block(body, HERMES_END, out)
                continue
            start = self.buffer.find(HERMES_START)
            if start < 0:
                safe = len(self.buffer) - _partial_suffix(self.buffer, HERMES_START)
                self._text(self.buffer[:safe], out)
                self.buffer = self.buffer[safe:]
                return out
            self._text(self.buffer[:start], out)
            if self.has_text and self.spaces:
                out.append(self.spaces)
            self.before, self.spaces = ("" if self.has_text else self.spaces), ""
            self.buffer = self.buffer[start + len(HERMES_START):]
            self.in_call = True

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.in_call:  # NOTE: a last block left open (the model stopped at its end) counts if it is whole JSON
            self._block(self.buffer, "", out)
        else:
            self._text(self.buffer, out)
        if self.spaces and (self.has_text or not self.called):
            out.append(self.spaces)
        self.buffer = self.spaces = ""
        return out

    def _text(self, text: str, out: list[Piece]) -> None:
        text = self.spaces + text
        kept = text.rstrip()
        if kept:
            out.append(kept)
            self.has_text = True
        self.spaces = text[len(kept):]

    def _block(self, body: str, end: str, out: list[Piece]) -> None:
        self.in_call = False
        call = _json_call(body.strip())
        if call is None:  # not a call: the block is content, as written
            out.append(self.before + HERMES_START + body + end)
            self.has_text = True
            return
        out.append(call)
        self.called, self.has_text = True, False


class Llama3JsonParser:
    """A whole answer of ``;``-separated JSON calls (after an optional ``<|python_tag|>``): held
    back from its first character on, and read at the end; any other answer streams as content."""

    def __init__(self) -> None:
        self.buffer = ""
        self.mode: str | None = None  # None: undecided; "calls": held to the end; "text": content

    def feed(self, text: str) -> list[Piece]:
        if self.mode == "text":
            return [text] if text else []
        self.buffer += text
        head = self.buffer.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
            return []  # NOTE: whitespace, or the tag's beginning: not yet known
        if head.startswith(("{", PYTHON_TAG)):
            self.mode = "calls"
            return []
        self.mode, rest, self.buffer = "text", self.buffer, ""
        return [rest]

    def finish(self) -> list[Piece]:
        text, self.buffer = self.buffer, ""
        if self.mode == "calls":
            calls = _json_calls(text.lstrip().removeprefix(PYTHON_TAG))
            if calls:
                return list(calls)
        return [text] if text else []


def _json_calls(text: str) -> list[ParsedCall] | None:
    """JSON objects separated by ``;`` (and whitespace), each a call; None if any is not."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = call_of(value)
        if call is None:
            return None
        calls.append(call)


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def new_parser(name: str) -> HermesParser | Llama3JsonParser:
    """A parser of ``name`` (one of ``PARSERS``) for one answer."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser: {name!r} is not a parser (they are: {', '.join(PARSERS)})") from None


def parse(name: str, text: str) -> Parsed:
    """A whole answer read by parser ``name``: its content and calls, as a stream of it gives them.

    Without a call the content is the text as it is; with calls, the text around them (None if
    only whitespace)."""
    parser = new_parser(name)
    pieces = parser.feed(text) + parser.finish()
    calls = [p for p in pieces if isinstance(p, ParsedCall)]
    content = "".join(p for p in pieces if isinstance(p, str))
    if calls and not content.strip():
        return Parsed(None, calls)
    return Parsed(content, calls)
