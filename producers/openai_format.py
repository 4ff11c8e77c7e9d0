"""OpenAI completions / chat bodies -> protocol jobs (results -> responses: ``openai_responses``).

The one translation of both ``sluiceway serve`` (``gateway/translate.py`` raises it again as
its 400) and ``sluiceway bulk --format openai``, so a batch line becomes the same job and its
result the same response body either way. Torch-free and FastAPI-free: ``gateway`` imports
``producers``, never the reverse.

``translate_request`` checks a body the way the OpenAI API does (a bad field raises
``RequestError``, ``producers.openai_errors``, naming it) and then the way a worker would
(``producers.jobs.make_job``: the protocol's types and limits), so a request a worker would
refuse is refused before it is enqueued. What the response needs (endpoint, model, the
logprobs asked for, echo) rides in the job's ``metadata`` under ``gateway``; the result carries
the metadata back, so ``producers.openai_responses.translate_result`` needs the result alone.
A completions body with several prompts (``producers.openai_completions``) becomes one job per
prompt, all checked before any is enqueued; ``translate_results`` joins their results. A batch
line's body does the same (``batch_jobs``): a line of several prompts is several jobs and one answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from producers.errors import InvalidJob
from producers.jobs import make_job
from producers.openai_completions import (  # noqa: F401  (MAX_PROMPTS: documented, and imported from here)
    COMPLETION_MAX_TOKENS,
    ECHO_READS,
    MAX_PROMPTS,
    check_completion_only,
    completion_prompts,
    echo,
)
from producers.openai_chat import chat_messages, refuse_audio
from producers.openai_errors import RequestError, invalid_value
from producers.openai_tools import ToolError, ToolRequest, tool_request, use_tools
from producers.protocol import Job, check_job_id
from producers.protocol.limits import abbreviate

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


Endpoint = Literal["completion", "chat"]
ENDPOINTS: dict[str, Endpoint] = {COMPLETIONS_URL: "completion", CHAT_URL: "chat"}
URLS = tuple(ENDPOINTS)
META = "gateway"  # the job metadata key of what the response needs
TIERS = ("interactive", "bulk")

# OpenAI's name -> the protocol's ``sampling`` name, for fields that are copied as they are.
# NOTE: vLLM's extra parameters are taken where the engine has them (``top_k``, ``min_p``,
# ``repetition_penalty``, ``ignore_eos``, ...), under vLLM's names, as vLLM's server takes them.
SAMPLING_FIELDS = {
    "n": "n", "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias",
    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos",
    "min_tokens": "min_tokens", "stop_token_ids": "stop_token_ids", "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output", "bad_words": "bad_words",
    "allowed_token_ids": "allowed_token_ids", "truncate_prompt_tokens": "truncate_prompt_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens", "structured_outputs": "structured_outputs",
}
# Fields the API defines that change nothing a worker computes (who asks, what to keep, cache
# routing hints), with their JSON types as OpenAI checks them (null: not given).
IGNORED_TYPES: dict[str, tuple[type, str]] = {
    "user": (str, "a string"), "safety_identifier": (str, "a string"), "prompt_cache_key": (str, "a string"),
    "reasoning_effort": (str, "a string"), "store": (bool, "a boolean"), "metadata": (dict, "an object"),
    "prediction": (dict, "an object"), "verbosity": (str, "a string")}
IGNORED = frozenset(IGNORED_TYPES)
COMMON = frozenset({"model", "stream", "stream_options", "max_tokens", "priority", "service_tier", "response_format",
                    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"}) | IGNORED | frozenset(
    SAMPLING_FIELDS)
KNOWN = {"completion": COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"},
         "chat": COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "modalities", "audio"}}
UNSPOKEN = "unsupported_protocol_revision"  # the error code of a job the live workers cannot read (a 400)


@dataclass(frozen=True)
class OpenAIRequest:
    """One completions or chat body, checked: the protocol job it becomes and how to answer."""

    endpoint: Endpoint
    model: str
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    tier: str  # "interactive" or "bulk": which of the model's queues
    job: dict[str, Any]  # ``make_job`` / ``Client.submit`` keyword arguments (no id, no queue); the first prompt's
    # completions: every prompt of the body (``{"prompt": ...}`` or ``{"prompt_token_ids": ...}``), each its own job
    prompts: tuple[dict[str, Any], ...] = ()
    checked: tuple[Job, ...] = field(default=(), compare=False, repr=False)  # the jobs built when they were checked

    def to_job(self, job_id: str | None = None) -> Job:
        """The protocol job (the first prompt's): the one checked at translation (its unguessable
        id made then), or with ``job_id`` a new one of that id."""
        if job_id is None and self.checked:
            return self.checked[0]
        return make_job(**self.job, job_id=job_id)

    def to_jobs(self) -> list[Job]:
        """One checked job per prompt, in the body's order (a chat, or a single prompt: one)."""
        return list(self.checked) or [self.to_job()]

    def prompt_kwargs(self) -> list[dict[str, Any]]:
        """``job`` once per prompt, each with its own prompt."""
        if len(self.prompts) <= 1:
            return [self.job]
        common = {k: v for k, v in self.job.items() if k not in ("prompt", "prompt_token_ids")}
        return [{**common, **prompt} for prompt in self.prompts]

    def job_dict(self, job_id: str | None = None) -> dict[str, Any]:
        """The protocol job as the JSON object a stream entry holds."""
        return self.to_job(job_id).model_dump(mode="json")


def translate_request(endpoint: Endpoint, body: Any, *, tenant: str | None = None, tier: str | None = None,
                      priority: int | None = None, deadline: float | None = None,
                      tool_parser: str | None = None) -> OpenAIRequest:
    """``body`` (parsed JSON) as a protocol job; ``RequestError`` names the bad field.

    ``tenant`` goes into the job's metadata; ``tier`` and ``priority`` (a header's choice) win
    over the body's ``service_tier`` (``flex`` -> ``bulk``) and ``priority``; ``deadline`` (a
    unix time) is the job's. ``tool_parser`` (``--tool-call-parser``) reads the calls of a chat
    whose ``tool_choice`` is auto; None refuses auto tool choice (``producers.openai_tools``).
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - KNOWN[endpoint])
    if unknown:
        raise RequestError(f"unrecognized request argument supplied: {', '.join(unknown)}", unknown[0],
                           code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_value("model", model, "must be the name of a served model (GET /v1/models)")
    _refuse_functions(body, endpoint)
    refuse_audio(body)
    for name, (kind, described) in IGNORED_TYPES.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise invalid_value(name, body[name], f"must be {described}")
    stream = _bool(body, "stream", False)
    include_usage = _stream_options(body, stream)
    sampling = {SAMPLING_FIELDS[k]: v for k, v in body.items() if k in SAMPLING_FIELDS and v is not None}
    if isinstance(sampling.get("logit_bias"), dict):
        sampling["logit_bias"] = {str(k): v for k, v in sampling["logit_bias"].items()}
    meta: dict[str, Any] = {"endpoint": endpoint, "model": model, "created": int(time.time())}
    tools = None
    prompts: list[dict[str, Any]] = []
    if endpoint == "completion":
        prompts = completion_prompts(body)
        prompt = prompts[0]
        check_completion_only(body)
        # NOTE: a null is not given (as OpenAI reads it): the default, not the context's end
        max_tokens = _given(body, "max_tokens", COMPLETION_MAX_TOKENS)
        if body.get("logprobs") is not None:
            sampling["logprobs"] = meta["logprobs"] = _int(body, "logprobs", 0, 20)
        if _bool(body, "echo", False):
            max_tokens = echo(sampling, meta, max_tokens)
    else:
        prompt = {"messages": chat_messages(body.get("messages"))}
        tools = _tools(body, tool_parser)
        # NOTE: a null max_completion_tokens is not given: clients that fill every field send
        # one beside the max_tokens they mean, which must not lift the limit
        max_tokens = _given(body, "max_completion_tokens", _given(body, "max_tokens"))
        if _bool(body, "logprobs", False):
            sampling["logprobs"] = meta["logprobs"] = _int(body, "top_logprobs", 0, 20) if body.get(
                "top_logprobs") is not None else 0
        elif body.get("top_logprobs") is not None:
            raise invalid_value("top_logprobs", body["top_logprobs"], "needs logprobs: true")
    sampling["max_tokens"] = max_tokens
    structured = _response_format(body.get("response_format"))
    if structured is not None:
        if "structured_outputs" in sampling:
            raise RequestError("give response_format or structured_outputs, not both", "response_format")
        sampling["structured_outputs"] = structured
    if tools is not None:
        try:
            use_tools(tools, prompt, sampling, meta, body)
        except ToolError as exc:
            raise RequestError(str(exc), exc.param) from None
    metadata = {META: meta}
    if tenant is not None:
        metadata["tenant"] = tenant
    job = {**prompt, "sampling": sampling, "priority": _priority(body) if priority is None else priority,
           "stream": stream, "metadata": metadata, "deadline": deadline}
    request = OpenAIRequest(endpoint=endpoint, model=model, stream=stream, include_usage=include_usage,
                            tier=tier or _tier(body), job=job, prompts=tuple(prompts))
    return replace(request, checked=_check_jobs(request))


def _check_jobs(request: OpenAIRequest) -> tuple[Job, ...]:
    """The worker's own checks (``make_job``) of each prompt's job, its messages mapped back to
    the OpenAI names; of several prompts, the one at fault is named (``prompt.3``)."""
    jobs = []
    several = len(request.prompts) > 1
    for i, kwargs in enumerate(request.prompt_kwargs()):
        try:
            jobs.append(make_job(**kwargs))
        except InvalidJob as exc:
            message = str(exc)
            param = error_param(message, request.endpoint)
            if param == "structured_outputs" and "not a sampling field" in message:
                raise RequestError("response_format / structured_outputs: this deployment has no structured"
                                   " outputs (its engine is older than them)", "response_format") from None
            if several and param == "prompt":
                message, param = f"prompt.{i}: {message}", f"prompt.{i}"
            raise RequestError(message, param) from None
    return tuple(jobs)


def result_reads(job: Job) -> tuple[str, ...]:
    """The result fields of a later protocol revision that the answer to ``job`` reads (an echo's:
    ``ECHO_READS``), for ``producers.protocol.revisions.job_needs``."""
    return ECHO_READS if job.metadata.get(META, {}).get("echo") else ()


def revision_param(field: str) -> str:
    """The request field behind a job's field of a later revision (``Need.field``): ``echo`` for
    the result fields an echo reads, the field itself otherwise (``tools``, ``messages.1.tool_calls``)."""
    return "echo" if field in ECHO_READS else field


def error_param(message: str, endpoint: Endpoint) -> str | None:
    """The request field (OpenAI's ``param``) that a job's error names first, or None.

    ``sampling.top_p: ...`` -> ``top_p``; ``sampling: logit_bias[5] must be ...`` -> ``logit_bias``;
    a worker's ``prompt_token_ids: 9 is not a token id`` or ``prompt is 9,000 tokens long`` ->
    ``prompt`` (``messages`` on chat, as OpenAI names a context overflow); ``logprobs`` on chat ->
    ``top_logprobs``."""
    where, _, rest = message.partition(":")
    if where == "sampling":
        where = rest.strip().split(" ", 1)[0].split("[", 1)[0]
    param = where.split(" ", 1)[0].removeprefix("sampling.").split(".")[0]
    if param in ("prompt", "prompt_token_ids"):
        return "messages" if endpoint == "chat" else "prompt"
    if param == "logprobs" and endpoint == "chat":
        return "top_logprobs"
    return param if param in KNOWN[endpoint] or param == "messages" else None


def _refuse_functions(body: dict[str, Any], endpoint: Endpoint) -> None:
    """The legacy ``functions`` / ``function_call`` (OpenAI's deprecated form of tools) are refused,
    naming the fields that replace them; completions take no tools at all."""
    for name, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        if body.get(name) not in (None, [], "none"):
            raise RequestError(f"{name}: the deprecated functions API is not supported by this server; send"
                               f" {instead} (tool calling)", name)
    if endpoint == "completion":
        for name in ("tools", "tool_choice"):
            if body.get(name) not in (None, [], "none"):
                raise RequestError(f"{name}: tool calling is for /v1/chat/completions", name)
        # NOTE: ignored there, as it was before tools (its type checked, as OpenAI checks it)
        if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
            raise invalid_value("parallel_tool_calls", body["parallel_tool_calls"], "must be a boolean")


def _tools(body: dict[str, Any], tool_parser: str | None) -> ToolRequest | None:
    try:
        return tool_request(body, tool_parser)
    except ToolError as exc:
        raise RequestError(str(exc), exc.param, code="invalid_value") from None


def _given(body: dict[str, Any], name: str, default: Any = None) -> Any:
    """The field's value, or ``default`` when it is absent or null (as the API reads a null)."""
    value = body.get(name)
    return default if value is None else value


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_value(name, value, "must be a boolean")
    return value


def _int(body: dict[str, Any], name: str, low: int, high: int) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid_value(name, value, f"must be an integer in [{low}, {high}]")
    return value


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid_value("stream_options", options, "is allowed only with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise invalid_value("stream_options", options, "must be an object with include_usage")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise invalid_value("stream_options.include_usage", usage, "must be a boolean")
    # NOTE: vLLM's usage on every chunk needs the prompt's length mid-stream, which a token
    # entry does not carry: refused rather than answered without it
    if options.get("continuous_usage_stats") not in (None, False):
        raise invalid_value("stream_options.continuous_usage_stats", options["continuous_usage_stats"],
                            "is not supported (include_usage gives the usage in the last chunk)")
    return usage


def _priority(body: dict[str, Any]) -> int:
    value = body.get("priority", 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_value("priority", value, "must be an integer (higher runs first)")
    return value


def _tier(body: dict[str, Any]) -> str:
    # NOTE: OpenAI's "flex" tier is its slower, cheaper one: our bulk queue. Every other tier
    # (auto, default, priority) is interactive.
    tier = body.get("service_tier")
    if tier not in (None, "auto", "default", "flex", "priority", *TIERS):
        raise invalid_value("service_tier", tier, "must be auto, default, flex, priority, interactive or bulk")
    return "bulk" if tier in ("flex", "bulk") else "interactive"


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as the protocol's ``sampling.structured_outputs``."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid_value("response_format.json_schema", spec, "must be an object with a schema object")
        return {"json": spec.get("schema", {})}
    raise invalid_value("response_format.type", kind if isinstance(value, dict) else value,
                        "must be text, json_object or json_schema")


# -- batch lines (the gateway's /v1/batches and ``bulk --format openai``) ---------------------

def prompt_job_id(job_id: str, index: int) -> str:
    """The job id of a batch line's prompt ``index``: the line's own (``job_id``) for its first
    prompt, ``{job_id}-{index}`` for the others, so a line fed again derives the same ids."""
    return job_id if index == 0 else f"{job_id}-{index}"


def batch_jobs(url: Any, body: Any, job_id: str, *, tenant: str | None = None, deadline: float | None = None,
               tool_parser: str | None = None) -> list[Job]:
    """A batch line's ``url`` and ``body`` as its jobs (the bulk tier), one per prompt as the endpoint
    makes them, the first of id ``job_id`` (``prompt_job_id``); ``RequestError`` names the field.
    ``deadline`` (a unix time) is the batch's expiry; ``tool_parser`` reads the calls of a line
    whose ``tool_choice`` is auto (None refuses it), as the gateway's."""
    endpoint = ENDPOINTS.get(url) if isinstance(url, str) else None
    if endpoint is None:
        raise RequestError(f"url {abbreviate(url)} is not supported; it must be one of {', '.join(URLS)}", "url")
    if isinstance(body, dict) and body.get("stream"):
        raise RequestError("stream: a batch request cannot stream (its answer is a line of the output file)",
                           "stream")
    request = translate_request(endpoint, body, tenant=tenant, tier="bulk", deadline=deadline, tool_parser=tool_parser)
    checked = request.to_jobs()
    check_job_id(prompt_job_id(job_id, len(checked) - 1))  # the line's longest id holds all the others
    # NOTE: the jobs checked at translation under the line's own ids: building them again costs as
    # much as the translation itself, and an id is all that differs.
    return [job.model_copy(update={"id": prompt_job_id(job_id, i)}) for i, job in enumerate(checked)]
