"""OpenAI tool calling on chat: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as a job,
and the tool calls of its answer, whole (``answer``) or streamed (``ToolDeltas``: each call's
arguments as the model writes them).

The job carries the tools (protocol 1.3) so the model's chat template shows them. How the
answer becomes calls follows ``tool_choice``, as in vLLM:

- ``none``: the answer is content (the template still shows the tools).
- ``auto`` (the default when tools are given): the model chooses, and a tool-call parser
  (``producers.tool_parsers``, the one ``--tool-call-parser`` names) reads its calls out of the
  text. Without ``--enable-auto-tool-choice`` it is refused, as vLLM refuses it.
- ``required`` or a named function: constrained decoding (``sampling.structured_outputs``) with
  a JSON Schema built from the tools, so the answer is always a well-formed call: a named
  function's answer is its arguments, a required one an array of ``{"name", "parameters"}``
  (exactly one when ``parallel_tool_calls`` is false).

What the answer needs (the mode, the name, the parser) rides in the job's metadata under the
translation's key (``TOOLS``), so the result alone makes the response.
"""

from __future__ import annotations

import copy
import secrets
from dataclasses import dataclass
from typing import Any

from engine.structured_outputs import check_schema
from producers.call_scanner import CallScanner, CallText
from producers.protocol.limits import MAX_TOOLS, abbreviate
from producers.protocol.tools import check_parameters, check_tool_name, parse_arguments
from producers.tool_parsers import PARSERS, ParsedCall, Piece, joined_calls, new_parser, parse

TOOLS = "tools"  # the key of the answer's needs in the job's gateway metadata
FUNCTION_KEYS = ("name", "description", "parameters", "strict")  # what a declared function may carry
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # none declared: no arguments


class ToolError(ValueError):
    """A tool field of a body that cannot become a job: ``param`` names it (OpenAI's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    """A chat body's tools, checked: what its job carries and how its answer is read."""

    tools: list[dict[str, Any]]  # the job's ``tools``
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    parser: str | None = None  # auto: the tool-call parser
    parallel: bool = True  # parallel_tool_calls

    @property
    def structured(self) -> dict[str, Any] | None:
        """The constraint of a required or named answer (``sampling.structured_outputs``)."""
        if self.mode == "named":
            function = next(t["function"] for t in self.tools if t["function"]["name"] == self.name)
            return {"json": function.get("parameters") or dict(EMPTY_PARAMETERS)}
        if self.mode == "required":
            return {"json": required_schema(self.tools, self.parallel)}
        return None

    @property
    def meta(self) -> dict[str, Any] | None:
        """What the answer needs, for the job's metadata; None when it is plain content."""
        if self.mode == "none":
            return None
        meta: dict[str, Any] = {"mode": self.mode, "parallel": self.parallel}
        if self.name is not None:
            meta["name"] = self.name
        if self.parser is not None:
            meta["parser"] = self.parser
        return meta


def tool_request(body: dict[str, Any], parser: str | None) -> ToolRequest | None:
    """The body's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, checked; None without tools.

    ``parser``: the auto tool choice's parser (``--tool-call-parser``: the gateway's for the body's
    model), None when auto tool choice is not enabled (``--enable-auto-tool-choice``) or the model
    has no parser."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", f"must be a boolean, got {abbreviate(parallel)}")
    tools = declared_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", f"{abbreviate(choice)} needs tools; give tools, or leave tool_choice out")
        return None
    names = [t["function"]["name"] for t in tools]
    parallel = parallel is not False
    if choice is None or choice == "auto":
        if parser is None:
            raise ToolError("tool_choice", '"auto" tool choice (the default with tools) needs a server started with'
                                           " --enable-auto-tool-choice and a --tool-call-parser for this model;"
                                           ' give tool_choice "none", "required" or a named function here')
        return ToolRequest(tools, "auto", parser=parser, parallel=parallel)
    if choice in ("none", "required"):
        return ToolRequest(tools, choice, parallel=parallel)
    name = _named(choice)
    if name not in names:
        raise ToolError("tool_choice.function.name", f"{name!r} is not one of the tools ({', '.join(names)})")
    return ToolRequest(tools, "named", name=name, parallel=parallel)


def use_tools(tools: ToolRequest, prompt: dict[str, Any], sampling: dict[str, Any], meta: dict[str, Any],
              body: dict[str, Any]) -> None:
    """A chat's tools into its job (``prompt``: its messages, ``sampling``, ``meta``: the gateway's
    metadata): the tools for the template, the constraint of a required or named answer, and what
    the answer needs."""
    prompt["tools"] = tools.tools
    if tools.meta is not None:
        meta[TOOLS] = tools.meta
    if tools.mode == "auto" and "skip_special_tokens" not in sampling:
        # NOTE: as vLLM's hermes parser asks: some tokenizers mark <tool_call> special, and a
        # skipped one leaves the call as bare JSON in the content
        sampling["skip_special_tokens"] = False
    constraint = tools.structured
    if constraint is None:
        return
    if "structured_outputs" in sampling:
        given = "response_format" if body.get("response_format") is not None else "structured_outputs"
        choice = "required" if tools.mode == "required" else "naming a function"
        raise ToolError(given, f"give tool_choice {choice} or {given}, not both: both constrain the answer")
    for i, tool in enumerate(tools.tools):
        if tools.mode == "required" or tool["function"]["name"] == tools.name:
            try:
                check_schema(tool["function"].get("parameters", {}), f"tools.{i}.function.parameters")
            except ValueError as exc:
                place, _, detail = str(exc).partition(": ")
                raise ToolError(place, f"{detail} (tool_choice {tools.mode} enforces it)") from None
    sampling["structured_outputs"] = constraint


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or choice.get("type") != "function":
        raise ToolError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function":'
                                       f' {{"name": ...}}}}, got {abbreviate(choice)}')
    if not isinstance(function.get("name"), str):
        raise ToolError("tool_choice.function.name",
                        f"must be a function's name, got {abbreviate(function.get('name'))}")
    return function["name"]


def declared_tools(value: Any) -> list[dict[str, Any]]:
    """``tools`` as the job carries them (each function's known fields); [] for none given."""
    if value is None or value == []:
        return []
    if not isinstance(value, list):
        raise ToolError("tools", f"must be an array of tools, got {abbreviate(value)}")
    if len(value) > MAX_TOOLS:
        raise ToolError("tools", f"{len(value):,} tools is over the limit of {MAX_TOOLS} (MAX_TOOLS)")
    tools, seen = [], {}
    for i, tool in enumerate(value):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ToolError(f"{where}.type",
                            f'must be "function" (the only kind of tool served), got {abbreviate(kind)}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{where}.function", f"must be an object with a name, got {abbreviate(function)}")
        name = function.get("name")
        if not isinstance(name, str):
            raise ToolError(f"{where}.function.name", f"must be a string, got {abbreviate(name)}")
        try:
            check_tool_name(name)
        except ValueError as exc:
            raise ToolError(f"{where}.function.name", str(exc)) from None
        if name in seen:
            raise ToolError(f"{where}.function.name", f"{name!r} is declared twice (first at tools.{seen[name]})")
        seen[name] = i
        _check_function(function, where)
        # NOTE: known fields only, as vLLM reads a function (it warns of the rest and drops them)
        tools.append({"type": "function", "function": {k: function[k] for k in FUNCTION_KEYS
                                                      if function.get(k) is not None}})
    return tools


def _check_function(function: dict[str, Any], where: str) -> None:
    for key, kind, described in (("description", str, "a string"), ("parameters", dict, "a JSON Schema object"),
                                 ("strict", bool, "a boolean")):
        value = function.get(key)
        if value is not None and not isinstance(value, kind):
            raise ToolError(f"{where}.function.{key}", f"must be {described}, got {abbreviate(value)}")
    if function.get("parameters") is not None:
        try:
            check_parameters(function["parameters"])
        except ValueError as exc:
            raise ToolError(f"{where}.function.parameters", str(exc)) from None


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON Schema of a required answer: an array of one or more (one, without parallel calls)
    ``{"name": <a tool's name>, "parameters": <its arguments>}``, one ``anyOf`` branch per tool.

    Each function's ``$defs`` move to the root, where its ``#/$defs/...`` references then point;
    two functions that define one name differently are a ``ToolError``."""
    defs: dict[str, Any] = {}
    branches = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        parameters = copy.deepcopy(function.get("parameters") or EMPTY_PARAMETERS)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ToolError(f"tools.{i}.function.parameters.$defs.{name}",
                                "another tool defines this name differently; tool_choice required puts every"
                                " tool's $defs together")
        branches.append({"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                                          "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def message_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as the job carries them (``where``: the message's place)."""
    if not isinstance(value, list) or not value:
        raise ToolError(f"{where}.tool_calls", f"must be a non-empty array of tool calls, got {abbreviate(value)}")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls.{j}"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise ToolError(at, 'must be {"id", "type": "function", "function": {"name", "arguments"}}, got '
                                + abbreviate(call))
        if not isinstance(call.get("id"), str):
            raise ToolError(f"{at}.id", f"must be the call's id (a string), got {abbreviate(call.get('id'))}")
        name, arguments = function.get("name"), function.get("arguments", "")
        if not isinstance(name, str):
            raise ToolError(f"{at}.function.name", f"must be a string, got {abbreviate(name)}")
        if not isinstance(arguments, str):
            raise ToolError(f"{at}.function.arguments", f"must be a string of JSON, got {abbreviate(arguments)}")
        try:
            parse_arguments(arguments)
        except ValueError as exc:
            raise ToolError(f"{at}.function.arguments", str(exc)) from None
        calls.append({"id": call["id"], "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


# -- answers ---------------------------------------------------------------------------------

def call_id() -> str:
    """A tool call's id, as OpenAI's look: ``call_`` and 24 random characters."""
    return "call_" + secrets.token_hex(12)


def tool_call(call: ParsedCall, index: int | None = None) -> dict[str, Any]:
    """One call of a response (with ``index``: of a stream's ``delta.tool_calls``)."""
    entry: dict[str, Any] = {} if index is None else {"index": index}
    entry.update(id=call_id(), type="function", function={"name": call.name, "arguments": call.arguments})
    return entry


def required_calls(text: str) -> list[ParsedCall]:
    """A required answer's calls (an array of ``{"name", "parameters"}``) as a stream reads them:
    each call whose name's string has closed, with its ``parameters`` as far as the model wrote
    them, whole or cut by max_tokens (none when it was cut before a name closed).

    NOTE: a call's arguments are its ``parameters`` as the model wrote them (its whitespace kept),
    not re-serialized, nor dropped when cut: a stream sends that text as it comes
    (``CallScanner``), and the two join to the same string."""
    return joined_calls(CallScanner().feed(text))


def finish_reason(reason: str | None, called: bool, mode: str) -> str | None:
    """``tool_calls`` for an answer that ended by itself in calls the model chose (auto, required);
    the engine's reason otherwise: a named function's call ends ``stop``, as OpenAI and vLLM answer."""
    return "tool_calls" if called and reason == "stop" and mode != "named" else reason


def answer(text: str, reason: str | None, meta: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A whole answer's message (``content``, and ``tool_calls`` when it made any) and finish reason."""
    mode = meta["mode"]
    if mode == "named":  # NOTE: the answer is the arguments, however far it got (a stream sends them as they come)
        calls = [ParsedCall(meta["name"], text)]
        content = None
    elif mode == "required":  # NOTE: cut before a call's name closed, the answer is content, as a stream ends it
        calls = required_calls(text)
        content = None if calls else text
    else:
        parsed = parse(meta["parser"], text)
        calls, content = parsed.calls, parsed.content
    if not meta.get("parallel", True):
        calls = calls[:1]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [tool_call(c) for c in calls]
    return message, finish_reason(reason, bool(calls), mode)


class ToolDeltas:
    """One streamed choice's answer as ``delta`` fields: content as it may be sent, each call as
    ``tool_calls`` entries, as OpenAI streams them: a call's first entry carries its ``index``,
    ``id``, ``type`` and ``function.name`` (with the arguments so far, maybe ""), the next ones
    its ``index`` and the next ``function.arguments`` text, as the model writes them. Named and
    required answers send no content (their text is the calls), but for a required answer in
    which no call's name closed (cut by max_tokens), sent as content at its end; auto ones send
    the text their parser leaves around the calls."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.mode = meta["mode"]
        self.name = meta.get("name")
        self.limit = None if meta.get("parallel", True) else 1
        self.parser = new_parser(meta["parser"]) if self.mode == "auto" else None
        self.scanner = CallScanner() if self.mode == "required" else None
        self.unsent: list[str] = []  # required: the answer's text while no call went out
        self.calls = 0  # calls sent

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> dict[str, Any]:
        """The ``delta`` fields of ``text`` (``{}`` when nothing can be sent yet)."""
        if self.mode == "named":  # NOTE: the answer is the arguments, from its first character on
            return self._pieces([CallText(0, None if self.calls else self.name, text)])
        if self.mode == "required":
            fields = self._pieces(self.scanner.feed(text))
            if self.calls:
                self.unsent.clear()
            else:
                self.unsent.append(text)
            return fields
        return self._delta(self.parser.feed(text))

    def finish(self) -> dict[str, Any]:
        """The ``delta`` fields the answer's end lets go."""
        if self.mode == "named":
            return self.feed("") if self.calls == 0 else {}
        if self.mode == "required":  # NOTE: a call's characters went out as they came; one cut short stays cut
            text = "".join(self.unsent)
            return {"content": text} if text else {}  # no call's name closed: content, as the whole answer's
        return self._delta(self.parser.finish())

    def _pieces(self, pieces: list[CallText]) -> dict[str, Any]:
        """Calls read as they come: an opening entry for a piece with a name, a fragment otherwise."""
        entries = []
        for piece in pieces:
            if self.limit is not None and piece.index >= self.limit:
                continue
            if piece.name is not None:
                entries.append(tool_call(ParsedCall(piece.name, piece.arguments), piece.index))
                self.calls += 1
            elif piece.arguments:
                entries.append({"index": piece.index, "function": {"arguments": piece.arguments}})
        return {"tool_calls": entries} if entries else {}

    def _delta(self, pieces: list[Piece]) -> dict[str, Any]:
        content = "".join(p for p in pieces if isinstance(p, str))
        calls = self._pieces([p for p in pieces if isinstance(p, CallText)])
        return {"content": content, **calls} if content else calls


def check_parser(name: str | None) -> str | None:
    """``--tool-call-parser``: one of ``PARSERS`` (or None)."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"{name!r} is not a tool-call parser (they are: {', '.join(PARSERS)})")
    return name
