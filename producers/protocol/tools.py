"""Protocol v1.3's tool calling: a job's ``tools`` and the tool calls of its chat messages.

The worker hands both to the model's chat template as HF's ``apply_chat_template(messages,
tools=...)`` takes them (a tool call's ``arguments``, the JSON string OpenAI writes, parsed
into an object first, as vLLM does). Nothing here is run or evaluated: the model answers
text, which the OpenAI translation constrains and parses (``producers/openai_tools.py``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from producers.protocol.limits import MAX_TOOLS, abbreviate, check_size

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name


def check_tool_name(name: str) -> str:
    if not TOOL_NAME.fullmatch(name):
        raise ValueError(f"{abbreviate(name)} is not a function name: 1 to 64 characters from a-z A-Z 0-9 _ -")
    return name


def check_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    """A function's ``parameters``: the JSON Schema of an object (its arguments)."""
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ValueError(f"must be the JSON Schema of an object (type \"object\"), got type {abbreviate(kind)}")
    return parameters


def parse_arguments(arguments: str | dict[str, Any]) -> dict[str, Any]:
    """A tool call's ``arguments`` as an object: the JSON string OpenAI writes, parsed (an empty
    string is no arguments, as vLLM reads it); ``ValueError`` when it holds no JSON object."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc}): {abbreviate(arguments)}") from None
    if not isinstance(value, dict):
        raise ValueError(f"must hold a JSON object, got {abbreviate(arguments)}")
    return value


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the JSON Schema of its arguments, an object
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_tool_name(value)

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return value if value is None else check_parameters(value)


class Tool(BaseModel):
    """One entry of a job's ``tools``: a function the model may call, as OpenAI declares it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: ToolFunction


class ToolsError(ValueError):
    """A problem of ``tools`` as a whole, at ``place`` inside it (``"3.function.name"``, or ``""``)."""

    def __init__(self, place: str, detail: str) -> None:
        super().__init__(f"{place}: {detail}" if place else detail)
        self.place = place
        self.detail = detail


def check_tools(tools: list[Tool]) -> list[Tool]:
    """At most ``MAX_TOOLS``, not empty, each name once; ``ToolsError`` otherwise."""
    if not tools:
        raise ToolsError("", "must hold at least one tool (leave it out for none)")
    try:
        check_size("", len(tools), MAX_TOOLS, "MAX_TOOLS", "tools")
    except ValueError as exc:
        raise ToolsError("", str(exc)) from None
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise ToolsError(f"{i}.function.name", f"{name!r} is declared twice (first at tools.{seen[name]})")
        seen[name] = i
    return tools


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str | dict[str, Any]  # a JSON string holding an object (OpenAI's form), or the object

    @field_validator("arguments")
    @classmethod
    def _arguments(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        parse_arguments(value)
        return value


class ToolCall(BaseModel):
    """One call of an assistant message's ``tool_calls``, as OpenAI writes it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction
