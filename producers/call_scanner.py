"""An incremental reader of a required tool choice's answer: a JSON array of calls
``[{"name": ..., "parameters": {...}}, ...]``, read as its text arrives.

``CallScanner.feed`` takes the answer's text piece by piece, split anywhere (inside a string,
an escape or a key), and lets go, per call, its name once the name's string has closed and then
the characters of its ``parameters`` value as they come: the value's text exactly as written
(its own whitespace included, none around it), so a call's pieces join to that text. It
tracks strings (with their escapes) and nesting, nothing more: it does not check the JSON,
which constrained decoding guarantees; text of another shape lets go nothing it cannot place
(a root that is not an array, an item that is not an object, a call whose name is not a string).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
CALL_LEVEL = 2  # containers open inside a call's own object: the root array and the call


@dataclass(frozen=True)
class CallText:
    """What one ``feed`` lets go of one call: its next arguments text, and on its first piece its name."""

    index: int  # the call's place in the array
    name: str | None  # on the call's first piece alone
    arguments: str  # the next characters of its parameters' JSON text ("" on a first piece with none yet)


class CallScanner:
    """Reads a JSON array of ``{"name", "parameters"}`` objects piece by piece (``feed``)."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the open containers ("[" or "{"), outermost first
        self.in_string = False
        self.escaped = False  # in a string, after a backslash
        self.index = -1  # the call being read (-1 before the first)
        self.name: str | None = None  # its name, once its string closed
        self.opened = False  # its first piece went out
        self.held: list[str] = []  # its parameters' characters not yet let go
        self.parameters_read = False  # its parameters value ended (a repeated key is not read again)
        self.expect = "key"  # at the call's own level: "key", "colon", "value" or "comma"
        self.key: str | None = None  # the key whose value comes or is read
        self.literal: list[str] | None = None  # a key's or a name's string literal, while read
        self.value: str | None = None  # the call's value being read: "name", "parameters" or "other"
        self.scalar = False  # that value is a number, true, false or null
        self.out: list[CallText] = []

    def feed(self, text: str) -> list[CallText]:
        """What ``text``, the answer's next characters, lets go: at most one piece per call."""
        for ch in text:
            self._step(ch)
        self._let_go()
        out, self.out = self.out, []
        return out

    def _step(self, ch: str) -> None:
        if self.in_string:
            self._take(ch)
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self._at_call_level():
                    self._string_closed()
            return
        if self.scalar and ch not in "+-.eE0123456789truefalsn":  # a scalar ends at what is not its own
            self._value_closed()
        if self._at_call_level() and self.value is None:
            self._call_syntax(ch)
            return
        self._take(ch)
        if ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.stack.append(ch)
            if self._at_call_level():
                self._call_began()
        elif ch in "]}" and self.stack:
            self.stack.pop()
            if len(self.stack) == CALL_LEVEL and self.value is not None:  # the call's value closed with it
                self._value_closed()

    def _call_syntax(self, ch: str) -> None:
        """A character of the call's own object, outside its values: keys, ``:``, ``,``, its end."""
        if ch in WHITESPACE:
            return
        if ch == "}":
            self.stack.pop()
            self._let_go()
            self.name = None
        elif ch == ",":
            self.expect = "key"
        elif ch == ":":
            self.expect = "value"
        elif self.expect == "key" and ch == '"':
            self.in_string, self.literal = True, [ch]
        elif self.expect == "value":
            self._value_began(ch)

    def _call_began(self) -> None:
        self.index += 1
        self.name, self.opened, self.held, self.parameters_read = None, False, [], False
        self.expect, self.key, self.value = "key", None, None

    def _value_began(self, ch: str) -> None:
        if self.key == "name" and self.name is None and ch == '"':
            self.value, self.literal = "name", []
        elif self.key == "parameters" and not self.parameters_read:
            self.value = "parameters"
        else:
            self.value = "other"
        self._take(ch)
        if ch == '"':
            self.in_string = True
        elif ch in "[{":
            self.stack.append(ch)
        else:
            self.scalar = True

    def _string_closed(self) -> None:
        """A string at the call's own level closed: a key, or the name's or another value's."""
        if self.value is None:  # a key
            self.key = _decoded(self.literal)
            self.literal, self.expect = None, "colon"
            return
        self._value_closed()

    def _value_closed(self) -> None:
        if self.value == "name":
            self.name = _decoded(self.literal)
            self.literal = None
        elif self.value == "parameters":
            self.parameters_read = True
        self.value, self.scalar, self.expect = None, False, "comma"

    def _take(self, ch: str) -> None:
        if self.literal is not None:
            self.literal.append(ch)
        elif self.value == "parameters":
            self.held.append(ch)

    def _let_go(self) -> None:
        """The call's piece: its name once known, with what its parameters held."""
        if self.name is None or (self.opened and not self.held):
            return
        arguments = "".join(self.held)
        self.held.clear()
        self.out.append(CallText(self.index, None if self.opened else self.name, arguments))
        self.opened = True

    def _at_call_level(self) -> bool:
        return len(self.stack) == CALL_LEVEL and self.stack[0] == "[" and self.stack[1] == "{"


def _decoded(literal: list[str] | None) -> str | None:
    """A string literal's text (``"get_weather"`` -> ``get_weather``), None when it is not one."""
    try:
        value = json.loads("".join(literal or ()))
    except ValueError:
        return None
    return value if isinstance(value, str) else None
