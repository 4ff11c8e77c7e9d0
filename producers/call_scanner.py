"""An incremental reader of tool calls written as JSON: a required tool choice's array of calls
``[{"name": ..., "parameters": {...}}, ...]``, or calls written one object after another (a hermes
block's ``{"name": ..., "arguments": {...}}``, llama3_json's ``;``-separated ones), read as the
text arrives.

``CallScanner.feed`` takes the text piece by piece, split anywhere (inside a string, an escape or
a key), and lets go, per call, its name once the name's string has closed and then the characters
of its arguments value as they come: the value's text exactly as written (its own whitespace
included, none around it), so a call's pieces join to that text. Arguments written as a string
(as some models write them) go out decoded, once the string has closed; a call whose object
closes without arguments gets ``{}``. It tracks strings (with their escapes) and nesting, nothing
more: it does not check the JSON (constrained decoding guarantees a required answer's; a parser's
call has gone out before its end could show it broken); text of another shape lets go nothing it
cannot place (an item that is not an object, a call whose name is not a non-empty string, and in
an array's place anything else at its root).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
REQUIRED_ARGUMENTS = ("parameters",)  # the key of a required answer's arguments


@dataclass(frozen=True)
class CallText:
    """What one ``feed`` lets go of one call: its next arguments text, and on its first piece its name."""

    index: int  # the call's place among the calls read (an object that is no call takes none)
    name: str | None  # on the call's first piece alone
    arguments: str  # the next characters of its arguments' JSON text ("" on a first piece with none yet)


class CallScanner:
    """Reads ``{"name", <arguments key>}`` objects piece by piece (``feed``): the items of a JSON
    array (``array``), or objects one after another, whatever stands between them skipped.
    ``arguments``: the keys that may hold the arguments, the first one read counting."""

    def __init__(self, array: bool = True, arguments: tuple[str, ...] = REQUIRED_ARGUMENTS) -> None:
        self.root = "[{" if array else "{"  # the containers open inside a call's own object
        self.arguments_keys = arguments
        self.stack: list[str] = []  # the open containers ("[" or "{"), outermost first
        self.in_string = False
        self.escaped = False  # in a string, after a backslash
        self.calls = 0  # the calls opened
        self.index = -1  # the call being read, once opened
        self.name: str | None = None  # its name, once its string closed
        self.opened = False  # its first piece went out
        self.held: list[str] = []  # its arguments' characters not yet let go
        self.parameters_read = False  # its arguments value ended (a repeated key is not read again)
        self.expect = "key"  # at the call's own level: "key", "colon", "value" or "comma"
        self.key: str | None = None  # the key whose value comes or is read
        self.literal: list[str] | None = None  # a key's, a name's or string arguments' literal, while read
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
            if len(self.stack) == len(self.root) and self.value is not None:  # the call's value closed with it
                self._value_closed()

    def _call_syntax(self, ch: str) -> None:
        """A character of the call's own object, outside its values: keys, ``:``, ``,``, its end."""
        if ch in WHITESPACE:
            return
        if ch == "}":
            self.stack.pop()
            if self.name is not None and not self.parameters_read:
                self.held.append("{}")  # NOTE: a call written without arguments has none, as an empty object
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
        self.name, self.opened, self.held, self.parameters_read = None, False, [], False
        self.expect, self.key, self.value = "key", None, None

    def _value_began(self, ch: str) -> None:
        if self.key == "name" and self.name is None and ch == '"':
            self.value, self.literal = "name", []
        elif self.key in self.arguments_keys and not self.parameters_read:
            self.value = "parameters"
            if ch == '"':  # arguments written as a string: held whole, and let go decoded
                self.literal = []
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
            self.name = _decoded(self.literal) or None
            self.literal = None
        elif self.value == "parameters":
            if self.literal is not None:
                self.held.append(_decoded(self.literal) or "")
                self.literal = None
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
        if not self.opened:
            self.index, self.calls = self.calls, self.calls + 1
        arguments = "".join(self.held)
        self.held.clear()
        self.out.append(CallText(self.index, None if self.opened else self.name, arguments))
        self.opened = True

    def _at_call_level(self) -> bool:
        return len(self.stack) == len(self.root) and "".join(self.stack) == self.root


def _decoded(literal: list[str] | None) -> str | None:
    """A string literal's text (``"get_weather"`` -> ``get_weather``), None when it is not one."""
    try:
        value = json.loads("".join(literal or ()))
    except ValueError:
        return None
    return value if isinstance(value, str) else None
