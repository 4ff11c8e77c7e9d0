"""OpenAI request bodies as protocol jobs, and protocol results as OpenAI response objects.

Torch-free, so both ``sluiceway bulk --format openai`` (``producers/``) and the gateway's
Batch API (``gateway/``) use it: ``gateway`` may import ``producers``, never the reverse.
Only ``/v1/chat/completions`` and ``/v1/completions`` bodies are known. A body that cannot
be run raises ``RequestError`` naming the field (``param``), its value and the limit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from producers.protocol import ErrorCode, Job, JobResult, describe_validation_error
from producers.protocol.limits import abbreviate

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
# NOTE: OpenAI's own default for /v1/completions; a chat body without max_tokens runs to the
# end of the context, as OpenAI's does.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# body field -> SamplingParams field, for the fields both APIs spell the same way
_SAMPLING = {
    "temperature": "temperature", "top_p": "top_p", "n": "n", "seed": "seed",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    # vLLM's extra sampling fields, which its OpenAI server takes in the body too
    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens", "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens", "include_stop_str_in_output": "include_stop_str_in_output",
}
# fields a body may carry that change nothing here (or are answered by the envelope)
_IGNORED = frozenset({"model", "user", "stream", "stream_options", "metadata", "store", "service_tier",
                      "parallel_tool_calls", "echo_prompt"})
_CONTENT_PART_TYPES = ("text", "input_text")
_STATUS_OF_CODE = {
    ErrorCode.INVALID_JOB.value: 400, ErrorCode.CONTEXT_LENGTH_EXCEEDED.value: 400,
    ErrorCode.EXPIRED.value: 408, ErrorCode.CANCELLED.value: 499,
}


class RequestError(ValueError):
    """A body that cannot become a job: ``param`` names the field (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def request_to_job(url: str, body: Any, job_id: str, *, metadata: Mapping[str, Any] | None = None) -> Job:
    """One OpenAI request body of ``url`` as a validated protocol job with id ``job_id``."""
    if url not in URLS:
        raise RequestError(f"url {abbreviate(url)} is not supported; it must be one of {', '.join(URLS)}", "url")
    if not isinstance(body, dict):
        raise RequestError(f"body must be a JSON object, got {type(body).__name__}", "body")
    chat = url == CHAT_URL
    known = set(_SAMPLING) | _IGNORED | {"max_tokens", "stop", "logprobs", "top_logprobs", "logit_bias",
                                         "response_format", "tools", "tool_choice", "messages" if chat else "prompt"}
    if chat:
        known.add("max_completion_tokens")
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise RequestError(f"{unknown[0]}: not a supported field of a {url} body", unknown[0])
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise RequestError(f"model: expected a non-empty string, got {abbreviate(body.get('model'))}", "model")
    if body.get("tools") or body.get("tool_choice") not in (None, "none"):
        name = "tools" if body.get("tools") else "tool_choice"
        raise RequestError(f"{name}: tool calling is not supported", name)
    sampling = _sampling(body, chat)
    structured = _response_format(body.get("response_format"))
    if structured is not None:
        sampling["structured_outputs"] = structured
    data: dict[str, Any] = {"id": job_id, "sampling": sampling, "metadata": dict(metadata or {})}
    if chat:
        data["messages"] = _messages(body.get("messages"))
    else:
        data.update(_prompt(body.get("prompt")))
    try:
        return Job.model_validate(data)
    except ValidationError as exc:
        message = describe_validation_error(exc)
        if "structured_outputs: not a sampling field" in message:  # an engine older than structured outputs
            raise RequestError("response_format: this deployment has no structured outputs", "response_format") \
                from None
        raise RequestError(message, _param_of(message)) from None


def _sampling(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    sampling = {ours: body[theirs] for theirs, ours in _SAMPLING.items() if body.get(theirs) is not None}
    limit = body.get("max_completion_tokens") if chat else None
    limit = body.get("max_tokens") if limit is None else limit
    sampling["max_tokens"] = limit if limit is not None or chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    if body.get("stop") is not None:
        sampling["stop"] = body["stop"]
    if body.get("logit_bias") is not None:
        sampling["logit_bias"] = body["logit_bias"]
    logprobs = body.get("logprobs")
    if chat and logprobs is True:  # chat: logprobs is a flag, top_logprobs the count
        sampling["logprobs"] = body.get("top_logprobs") or 0
    elif chat and logprobs not in (None, False):
        raise RequestError(f"logprobs: expected a boolean, got {abbreviate(logprobs)}", "logprobs")
    elif not chat and logprobs is not None:
        sampling["logprobs"] = logprobs
    return sampling


def _response_format(value: Any) -> dict[str, Any] | None:
    """``response_format`` as the protocol's ``sampling.structured_outputs`` (None: free text)."""
    kind = value.get("type") if isinstance(value, dict) else value
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema") if kind == "json_schema" else None
    if isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict):
        return {"json": spec.get("schema", {})}
    raise RequestError(f"response_format: expected type text, json_object or json_schema (with a schema object),"
                       f" got {abbreviate(value)}", "response_format")


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages: expected a non-empty array, got {abbreviate(messages)}", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages.{i}: expected an object, got {abbreviate(message)}", f"messages.{i}")
        role = "system" if message.get("role") == "developer" else message.get("role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text can be run here
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in _CONTENT_PART_TYPES \
                        or not isinstance(part.get("text"), str):
                    raise RequestError(f"messages.{i}.content.{j}: only text parts are supported, got"
                                       f" {abbreviate(part)}", f"messages.{i}.content")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        out.append({"role": role, "content": content})
    return out


def _prompt(prompt: Any) -> dict[str, Any]:
    # NOTE: one prompt per request: a list of prompts would be several jobs under one response,
    # which a batch row (one custom_id, one job) cannot carry; send one row per prompt.
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    if isinstance(prompt, list) and len(prompt) == 1:
        return _prompt(prompt[0])
    raise RequestError(f"prompt: expected a string or an array of token ids (one prompt per request), got"
                       f" {abbreviate(prompt)}", "prompt")


def _param_of(message: str) -> str | None:
    head = message.split(":", 1)[0]
    return head if head and " " not in head else None


def response_body(url: str, model: str, request_id: str, result: JobResult, created: int | None = None) -> dict:
    """The OpenAI response object (``chat.completion`` or ``text_completion``) of a done job."""
    created = int(time.time()) if created is None else created
    chat = url == CHAT_URL
    choices = []
    for index, output in enumerate(result.outputs):
        if chat:
            choice = {"index": index, "message": {"role": "assistant", "content": output.text},
                      "logprobs": None, "finish_reason": output.finish_reason}
        else:
            choice = {"index": index, "text": output.text, "logprobs": None, "finish_reason": output.finish_reason}
        choices.append(choice)
    usage = result.usage
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                  "total_tokens": usage.prompt_tokens + usage.completion_tokens},
    }


def failure_status(error_code: str | None) -> int:
    """The HTTP status an OpenAI server would answer a job that ended with ``error_code``."""
    return _STATUS_OF_CODE.get(error_code or "", 500)
