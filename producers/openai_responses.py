"""Protocol results -> OpenAI response bodies, error envelopes and statuses.

The other half of ``producers.openai_format``: a job that ``translate_request`` made carries
what its response needs (endpoint, model, the logprobs asked for) in its metadata under
``META``, so ``translate_result`` needs the result alone. Torch-free and FastAPI-free, shared
by ``sluiceway serve`` and ``sluiceway bulk --format openai``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from producers.openai_format import META, Endpoint
from producers.openai_logprobs import chat_logprobs, completion_logprobs, plain
from producers.openai_tools import TOOLS, answer
from producers.protocol import ErrorCode, JobResult

NO_PROMPT = ("echo: the worker that ran this job did not return its prompt (prompt_text, prompt_first_token:"
             " protocol 1.4); run workers of this release")
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
    return translate_results([result], endpoint, model)


def translate_results(results: Sequence[JobResult | Mapping[str, Any]], endpoint: Endpoint = "completion",
                      model: str = "") -> dict[str, Any]:
    """The results of one request's jobs (a completions request's prompts, in order) as its one
    response: each job's ``n`` choices in turn (``index`` = prompt * n + choice, as vLLM numbers
    them), the usage summed, the first job's id."""
    datas = [r.model_dump() if isinstance(r, JobResult) else dict(r) for r in results]
    meta = (datas[0].get("metadata") or {}).get(META, {})
    endpoint = meta.get("endpoint", endpoint)
    choices: list[dict[str, Any]] = []
    for data in datas:
        for out in data["outputs"]:
            choice = {"index": len(choices), **_choice(data, out, endpoint, meta)}
            choices.append(choice)
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for data in datas:
        for name, count in usage_of(data).items():
            usage[name] += count
    return {"id": response_id(endpoint, datas[0]["id"]),
            "object": "chat.completion" if endpoint == "chat" else "text_completion",
            "created": meta.get("created", int(time.time())), "model": meta.get("model", model),
            "choices": choices, "usage": usage}


def _choice(data: Mapping[str, Any], out: Mapping[str, Any], endpoint: Endpoint,
            meta: Mapping[str, Any]) -> dict[str, Any]:
    """One completion of a result as a choice, less its index."""
    entries = out.get("top_logprobs") if meta.get("logprobs") is not None else None
    reason = finish_reason(out.get("finish_reason")) or "stop"
    choice: dict[str, Any] = {}
    if endpoint == "chat":
        choice["message"] = {"role": "assistant", "content": out["text"]}
        if meta.get(TOOLS) is not None:  # the answer's tool calls (producers/openai_tools.py)
            choice["message"], reason = answer(out["text"], reason, meta[TOOLS])
        choice["logprobs"] = chat_logprobs(entries) if entries is not None else None
    elif meta.get("echo"):
        text, prompt_entries = echoed_prompt(data)
        alone = meta["echo"] == "prompt"  # max_tokens 0: the prompt alone
        choice["text"] = text if alone else text + out["text"]
        if entries is not None:
            entries = prompt_entries if alone else [*prompt_entries, *entries]
        choice["logprobs"] = completion_logprobs(entries) if entries is not None else None
    else:
        choice["text"] = out["text"]
        choice["logprobs"] = completion_logprobs(entries) if entries is not None else None
    choice["finish_reason"] = reason
    return choice


def echoed_prompt(data: Mapping[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """An echo's prompt: its text and one logprob entry per token, the first's logprob and top
    None (nothing predicts it), from the job's prompt logprobs and what protocol 1.4 adds."""
    first, logprobs = data.get("prompt_first_token"), data.get("prompt_logprobs")
    if data.get("prompt_text") is None or first is None or not logprobs:
        raise ValueError(NO_PROMPT)
    first = first.model_dump() if hasattr(first, "model_dump") else first
    return data["prompt_text"], [{**first, "logprob": None, "top": None}, *plain(logprobs[1:])]


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def failure_status(error_code: str | None) -> int:
    """The HTTP status an OpenAI server would answer a job that ended with ``error_code``."""
    return _STATUS_OF_CODE.get(error_code or "", 500)
