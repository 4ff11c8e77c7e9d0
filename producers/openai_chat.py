"""What only ``/v1/chat/completions`` takes: its ``messages`` (roles, text content parts, an
assistant's ``tool_calls``, a tool message's ``tool_call_id``) and its output kinds.

Part of the one translation (``producers.openai_format.translate_request`` calls these); the
tools themselves are ``producers.openai_tools``.
"""

from __future__ import annotations

from typing import Any

from producers.openai_errors import RequestError, invalid_value
from producers.openai_tools import ToolError, message_tool_calls

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid_value("messages", messages, "must be a non-empty array of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise invalid_value(where, message, "must be an object with role and content")
        role = message.get("role")
        # NOTE: a string before the lookup: a list or an object is unhashable (was a TypeError, 500)
        if not isinstance(role, str) or role not in ROLES:
            raise invalid_value(f"{where}.role", role, f"must be one of {', '.join(ROLES)}")
        if message.get("function_call") is not None:
            raise RequestError(f"{where}.function_call: the deprecated function_call is not supported; send"
                               " tool_calls", f"{where}.function_call")
        item: dict[str, Any] = {"role": ROLES[role]}
        if message.get("tool_calls") not in (None, []):
            if role != "assistant":
                raise invalid_value(f"{where}.tool_calls", message["tool_calls"],
                                    "only an assistant message makes tool calls")
            try:
                item["tool_calls"] = message_tool_calls(message["tool_calls"], where)
            except ToolError as exc:
                raise RequestError(str(exc), exc.param, code="invalid_value") from None
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise invalid_value(f"{where}.tool_call_id", message.get("tool_call_id"),
                                    "must be the id of the tool call a tool message answers")
            item["tool_call_id"] = message["tool_call_id"]
        content = message.get("content")
        # NOTE: an assistant's calls may stand without content (null in the job); without calls a
        # null content is an empty one, as before tools
        item["content"] = None if content is None and "tool_calls" in item else _content(content, role,
                                                                                           f"{where}.content")
        out.append(item)
    return out


def _content(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid_value(f"{where}.{j}", part, "must be a text part ({\"type\": \"text\", \"text\": ...});"
                                                          " this server takes text only")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid_value(where, content, "must be a string or an array of text parts")


def refuse_audio(body: dict[str, Any]) -> None:
    """Chat's output kinds: ``modalities`` may ask for text alone, and ``audio`` (the voice of
    an audio answer) is refused, as a server that writes text only must answer them."""
    modalities = body.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
            raise invalid_value("modalities", modalities, 'must be a list of strings such as ["text"]')
        if set(modalities) - {"text"}:
            raise RequestError(f"modalities: this server answers in text only, got {modalities}", "modalities")
    if body.get("audio") is not None:
        raise RequestError("audio: audio output is not supported by this server", "audio")
