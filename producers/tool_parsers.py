"""Tool-call parsers: a model's answer -> its content and the tool calls written in it.

What vLLM's ``--tool-call-parser`` names, for answers whose request left the choice to the model
(``tool_choice`` "auto"):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the
  text (Hermes 2 Pro and later, Qwen2.5, Qwen3); the text around them is the content.
- ``llama3_json``: an answer that is one JSON object ``{"name": ..., "parameters": {...}}``, or
  several separated by ``;``, after an optional ``<|python_tag|>`` (Llama 3.1 to 3.3's JSON tool
  calling); any other answer is content.

Each parser reads text as it streams (``feed`` each delta, then ``finish``) and says what can be
sent: content, held back only while it may still begin a call, and each call as ``CallText``
pieces (``producers.call_scanner``): its name once the name's string has closed, then its
arguments' text as the model writes it. A whole answer is read the same way (``parse``), so a
streamed answer joins to the whole one. JSON whose name never closes stays content; once it has,
the call has gone out, and its arguments are what the model wrote, checked by no one (a stream
cannot take them back). Pure Python: the gateway runs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from producers.call_scanner import CallScanner, CallText

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")  # where a parser's call may hold its arguments


@dataclass(frozen=True)
class ParsedCall:
    """One call the model wrote: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


Piece = str | CallText  # what a parser lets go: content text, or a call's next piece


@dataclass(frozen=True)
class Parsed:
    """A whole answer, read: the content (None when the calls leave none) and the calls."""

    content: str | None
    calls: list[ParsedCall]


def joined_calls(pieces: Iterable[CallText]) -> list[ParsedCall]:
    """Each call of ``pieces`` whole: its name and its arguments' pieces joined, in call order."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for piece in pieces:
        if piece.name is not None:
            names[piece.index] = piece.name
        arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
    return [ParsedCall(names[i], arguments[i]) for i in sorted(names)]


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesParser:
    """``<tool_call>`` blocks. Text outside them is content as written, but a stretch of it that
    is only whitespace (the newlines a template puts around a block) is not: whitespace is held
    back until the text after it shows which it is. A block's body is read as it comes; one
    whose name never closed is content, as written, at its end."""

    def __init__(self) -> None:
        self.buffer = ""  # text not read yet: what may begin a block's start or end tag
        self.block: CallScanner | None = None  # the open block's reader
        self.body = ""  # the open block's body, while none of its calls went out (content if none does)
        self.opened = 0  # the open block's calls that went out
        self.calls = 0  # the calls of the blocks before it
        self.spaces = ""  # whitespace held back
        self.has_text = False  # the stretch since the last block holds more than whitespace
        self.before = ""  # the whitespace dropped before the open block (content again if it is no call)
        self.called = False

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while True:
            if self.block is not None:
                end = self.buffer.find(HERMES_END)
                if end < 0:  # NOTE: the body goes on, but for what may begin the end tag
                    safe = len(self.buffer) - _partial_suffix(self.buffer, HERMES_END)
                    self._body(self.buffer[:safe], out)
                    self.buffer = self.buffer[safe:]
                    return out
                self._body(self.buffer[:end], out)
                self.buffer = self.buffer[end + len(HERMES_END):]
                self._block_end(HERMES_END, out)
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
            self.block, self.body, self.opened = CallScanner(array=False, arguments=ARGUMENT_KEYS), "", 0

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.block is not None:  # NOTE: a last block left open (the model stopped at its end) is read as it is
            self._body(self.buffer, out)
            self._block_end("", out)
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

    def _body(self, text: str, out: list[Piece]) -> None:
        if not self.opened:
            self.body += text
        for piece in self.block.feed(text):
            out.append(CallText(self.calls + piece.index, piece.name, piece.arguments))
            if piece.name is not None:
                self.opened += 1
        if self.opened:
            self.body = ""

    def _block_end(self, end: str, out: list[Piece]) -> None:
        self.block = None
        if not self.opened:  # not a call: the block is content, as written
            out.append(self.before + HERMES_START + self.body + end)
            self.has_text = True
            return
        self.calls += self.opened
        self.called, self.has_text = True, False


class Llama3JsonParser:
    """An answer of ``;``-separated JSON calls (after an optional ``<|python_tag|>``), known from
    its first character: one that opens with ``{`` (or the tag) is read as calls as it comes, and
    held back until a call's name has closed; if none does, it is content at its end. Any other
    answer streams as content. Once a call went out, what stands between the objects beyond ``;``
    and whitespace, and an object that is no call, is dropped."""

    def __init__(self) -> None:
        self.buffer = ""  # the answer's text while no call went out: content, if none does
        self.mode: str | None = None  # None: undecided; "calls": read as calls; "text": content
        self.calls: CallScanner | None = None
        self.called = False

    def feed(self, text: str) -> list[Piece]:
        if self.mode == "text":
            return [text] if text else []
        if not self.called:
            self.buffer += text
        if self.mode == "calls":
            return self._scan(text)
        head = self.buffer.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
            return []  # NOTE: whitespace, or the tag's beginning: not yet known
        if head.startswith(("{", PYTHON_TAG)):
            self.mode, self.calls = "calls", CallScanner(array=False, arguments=ARGUMENT_KEYS)
            return self._scan(head.removeprefix(PYTHON_TAG))
        self.mode, rest, self.buffer = "text", self.buffer, ""
        return [rest]

    def finish(self) -> list[Piece]:
        text, self.buffer = self.buffer, ""
        return [text] if text and not self.called else []

    def _scan(self, text: str) -> list[Piece]:
        pieces: list[Piece] = list(self.calls.feed(text))
        if pieces:
            self.called, self.buffer = True, ""
        return pieces


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
    calls = joined_calls(p for p in pieces if isinstance(p, CallText))
    content = "".join(p for p in pieces if isinstance(p, str))
    if calls and not content.strip():
        return Parsed(None, calls)
    return Parsed(content, calls)
