"""OpenAI completions / chat bodies -> protocol jobs, and protocol results -> OpenAI responses.

The translation itself is ``producers.openai_format`` (torch-free, FastAPI-free, shared with
``sluiceway bulk --format openai``); this layer raises its ``RequestError`` again as the
gateway's ``InvalidRequest`` (a 400 naming the field) and keeps the names the routes use.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest
from gateway.model_parsers import NO_PARSERS, ModelParsers
from producers import openai_format as shared
from producers.openai_chat import ROLES  # noqa: F401  (re-exported: the routes and their tests use them)
from producers.openai_completions import COMPLETION_MAX_TOKENS  # noqa: F401
from producers.openai_errors import RequestError
from producers.openai_format import (  # noqa: F401
    ENDPOINTS,
    IGNORED,
    KNOWN,
    META,
    SAMPLING_FIELDS,
    TIERS,
    Endpoint,
    OpenAIRequest,
)
from producers.openai_responses import (  # noqa: F401
    finish_reason,
    response_id,
    translate_result,
    translate_results,
    usage_of,
)
from producers.protocol import Job


def as_invalid_request(exc: RequestError) -> InvalidRequest:
    """The shared translation's error as the gateway's 400 (same message, field and code)."""
    return InvalidRequest(exc.param, exc.message, code=exc.code)


def translate_request(endpoint: Endpoint, body: Any, *, tenant: str | None = None, tier: str | None = None,
                      priority: int | None = None, deadline: float | None = None,
                      tool_parsers: ModelParsers = NO_PARSERS) -> OpenAIRequest:
    """``body`` (parsed JSON) as a protocol job; ``InvalidRequest`` (400) names the bad field.

    ``tenant`` goes into the job's metadata; ``tier`` and ``priority`` (a header's choice) win
    over the body's ``service_tier`` (``flex`` -> ``bulk``) and ``priority``; ``deadline`` (a
    unix time) is the job's; an auto tool choice's calls are read by the parser ``tool_parsers``
    gives the body's model (none: refused).
    """
    try:
        return shared.translate_request(endpoint, body, tenant=tenant, tier=tier, priority=priority,
                                        deadline=deadline, tool_parser=tool_parsers.of_body(body))
    except RequestError as exc:
        raise as_invalid_request(exc) from None


def translate_line(url: Any, body: Any, job_id: str, tenant: str, deadline: float | None = None, *,
                   tool_parsers: ModelParsers = NO_PARSERS) -> list[Job]:
    """A batch line as its jobs, one per prompt, the first of id ``job_id``
    (``producers.openai_format.batch_jobs``), an auto tool choice read by the parser of the line's
    model, as the endpoint's; raises ``RequestError`` naming the field, which the batch turns into
    an error line."""
    return shared.batch_jobs(url, body, job_id, tenant=tenant, deadline=deadline,
                             tool_parser=tool_parsers.of_body(body))
