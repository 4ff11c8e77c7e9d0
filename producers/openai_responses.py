"""Protocol results -> OpenAI response bodies, error envelopes and statuses.

The other half of ``producers.openai_format``: a job that ``translate_request`` made carries
what its response needs (endpoint, model, the logprobs asked for) in its metadata under
``META``, so ``translate_result`` needs the result alone. Torch-free and FastAPI-free, shared
by ``sluiceway serve`` and ``sluiceway bulk --format openai``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from producers.openai_format import META, Endpoint
from producers.openai_logprobs import chat_logprobs, completion_logprobs
from producers.openai_tools import TOOLS, answer
from producers.protocol import ErrorCode, JobResult

_STATUS_OF_CODE = {
    ErrorCode.INVALID_JOB.value: 400, ErrorCode.CONTEXT_LENGTH_EXCEEDED.value: 400,
    ErrorCode.EXPIRED.value: 408, ErrorCode.CANCELLED.value: 499,
}


def response_id(endpoint: Endpoint, job_id: str) -> str:
    return f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{job_id}"


def finish_reason(reason: str | None) -> str | None:
    """The engine's reason as OpenAI names it (``stop``, ``length``)."""
    if reason is None:
        return None
    return reason if reason in ("stop", "length", "content_filter", "tool_calls") else "stop"


def usage_of(result: Mapping[str, Any]) -> dict[str, int]:
    usage = result["usage"]
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}


def translate_result(result: JobResult | Mapping[str, Any], endpoint: Endpoint = "completion",
                     model: str = "") -> dict[str, Any]:
    """A job's result as the OpenAI response object of the request it came from; ``endpoint``
    and ``model`` stand in for a result whose metadata lost them."""
    data = result.model_dump() if isinstance(result, JobResult) else dict(result)
    meta = (data.get("metadata") or {}).get(META, {})
    endpoint = meta.get("endpoint", endpoint)
    logprobs = meta.get("logprobs")
    choices = []
    tools = meta.get(TOOLS)
    for i, out in enumerate(data["outputs"]):
        entries = out.get("top_logprobs") if logprobs is not None else None
        choice: dict[str, Any] = {"index": i}
        reason = finish_reason(out.get("finish_reason")) or "stop"
        if endpoint == "chat":
            choice["message"] = {"role": "assistant", "content": out["text"]}
            if tools is not None:  # the answer's tool calls (producers/openai_tools.py)
                choice["message"], reason = answer(out["text"], reason, tools)
            choice["logprobs"] = chat_logprobs(entries) if entries is not None else None
        else:
            choice["text"] = out["text"]
            choice["logprobs"] = completion_logprobs(entries) if entries is not None else None
        choice["finish_reason"] = reason
        choices.append(choice)
    return {"id": response_id(endpoint, data["id"]),
            "object": "chat.completion" if endpoint == "chat" else "text_completion",
            "created": meta.get("created", int(time.time())), "model": meta.get("model", model),
            "choices": choices, "usage": usage_of(data)}


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def failure_status(error_code: str | None) -> int:
    """The HTTP status an OpenAI server would answer a job that ended with ``error_code``."""
    return _STATUS_OF_CODE.get(error_code or "", 500)
