"""The OpenAI Batch API's file formats: input request lines, output lines, error lines.

An input line is ``{"custom_id": str, "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}``; a line becomes one job per prompt, as the endpoint makes
them (a completions body of several prompts: several jobs). Each line ends in exactly one line,
keyed by its ``custom_id``: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}`` in the output file when its jobs are done (the body the endpoint answers), or
in the error file when the line is not a valid request (``response`` null, ``error`` ``{"code",
"message", "line"}``) or one of its jobs ended otherwise (``response`` holds the status and the
error envelope). Used by ``sluiceway bulk --format openai`` and the gateway's ``/v1/batches``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from producers.bulk_input import BadLine, parse_line
from producers.bulk_output import json_line
from producers.openai_errors import RequestError
from producers.openai_format import ENDPOINTS, UNSPOKEN, batch_jobs
from producers.openai_responses import error_body, failure_status, translate_results
from producers.protocol import TERMINAL_STATUSES, Job, JobResult, Status
from producers.protocol.limits import abbreviate

MAX_CUSTOM_ID_CHARS = 512  # OpenAI's own limit on custom_id
_LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
INVALID_REQUEST = "invalid_request"  # an error line's code: the line is not a request that can run
MODEL_NOT_FOUND = "model_not_found"  # an error line's code: no worker ever advertised the line's model
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"


@dataclass
class Request:
    """One input line: its jobs (one per prompt, the first's id the line's), or why it has none (``error``)."""

    line: int  # 1-based line number in the input file
    custom_id: str | None
    url: str | None
    model: str | None = None
    jobs: list[Job] = field(default_factory=list)
    error: str | None = None
    error_code: str = INVALID_REQUEST


# (url, body, job id) -> the line's jobs; raises RequestError naming the field
Translate = Callable[[Any, Any, str], list[Job]]


def default_translate(url: Any, body: Any, job_id: str) -> list[Job]:
    """The shared translation (``producers.openai_format.batch_jobs``): the gateway's batches use it too."""
    return batch_jobs(url, body, job_id)


@dataclass(frozen=True)
class JobEnd:
    """How one job of a line stands: its hash's status (None: no hash), result (JSON), error and
    error code, as ``HMGET`` reads them."""

    status: str | None
    result: str | None = None
    error: str | None = None
    code: str | None = None

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def failed(self) -> bool:
        """Ended otherwise than done: its line is an error line, and the line's other jobs are cancelled."""
        return self.ended and self.status != Status.DONE.value


@dataclass(frozen=True)
class LineEnd:
    """How a line's jobs ended, as one: ``results`` (every prompt's, in order) when all are done,
    else the status, error and code of the job that answers for the line."""

    status: str
    results: list[JobResult] | None = None
    error: str | None = None
    code: str | None = None


def line_end(ends: Sequence[JobEnd]) -> LineEnd:
    """The end of a line whose jobs (``ends``, in prompt order) have all ended: done with their
    results when each is; else the end of the first that failed or expired, or of the first
    cancelled when none did (a prompt that fails has the others cancelled: its failure answers
    for the line, as it answers for the endpoint's request). Of several prompts, the error
    names the one (``prompt.2: ...``)."""
    ends, results = list(ends), []
    for i, end in enumerate(ends):
        if end.status != Status.DONE.value:
            break
        try:
            results.append(JobResult.model_validate_json(end.result or ""))
        except ValueError:
            ends[i] = JobEnd(Status.FAILED.value, error="the job is done but its result is not valid")
            break
    else:
        return LineEnd(Status.DONE.value, results)
    failed = [i for i, end in enumerate(ends) if end.failed]
    first = next((i for i in failed if ends[i].status != Status.CANCELLED.value), failed[0])
    end = ends[first]
    error = f"prompt.{first}: {end.error or end.status}" if len(ends) > 1 else end.error
    return LineEnd(end.status, error=error, code=end.code)


def parse_request(line: int, raw: bytes, job_id: str, translate: Translate = default_translate) -> Request:
    """One input line as a ``Request``; never raises for what the line holds. ``translate``
    turns its body into its jobs (the gateway passes its own, so a batch line is checked the way
    the same request sent to the gateway is)."""
    try:
        data = parse_line(raw)
    except BadLine as exc:
        return Request(line, None, None, error=f"line {line}: {exc}")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Request(line, None, None, error=f"line {line}: custom_id: expected a non-empty string, got"
                                                f" {abbreviate(custom_id)}")
    request = Request(line, custom_id, None)
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        request.custom_id = None
        return _bad(request, f"custom_id is {len(custom_id):,} characters; the limit is {MAX_CUSTOM_ID_CHARS}")
    unknown = sorted(set(data) - _LINE_FIELDS)
    if unknown:
        return _bad(request, f"{abbreviate(unknown[0])}: not a field of a batch line (they are custom_id, method,"
                             " url, body)")
    if data.get("method") != "POST":
        return _bad(request, f"method: expected \"POST\", got {abbreviate(data.get('method'))}")
    url = data.get("url")
    request.url = url if isinstance(url, str) else None
    body = data.get("body")
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        request.model = body["model"]
    try:
        request.jobs = translate(url, body, job_id)
    except RequestError as exc:
        message = str(exc)
        if exc.param == "url" or message.startswith("body"):
            return _bad(request, message)
        head = message.split(":", 1)[0]  # a field path ("sampling.temperature") or a sentence
        return _bad(request, f"body.{message}" if head and " " not in head else f"body: {message}")
    return request


def _bad(request: Request, message: str) -> Request:
    request.error = f"line {request.line}: {message}"
    return request


def duplicate(request: Request, first_line: int) -> Request:
    """``request`` turned into the error of a custom_id that line ``first_line`` already has."""
    request.jobs = []
    request.error_code = DUPLICATE_CUSTOM_ID
    request.error = (f"line {request.line}: custom_id {abbreviate(request.custom_id)} is already the custom_id of"
                     f" line {first_line}; custom_ids must be unique within a file")
    return request


def unspoken(request: Request, param: str, reason: str) -> Request:
    """``request`` turned into the error of a line whose jobs need a later protocol revision than
    the live workers speak (``param`` the body's field, ``reason`` the revisions): the endpoint's
    400 ``unsupported_protocol_revision``, and its message after the line number."""
    request.jobs = []
    request.error_code = UNSPOKEN
    request.error = f"line {request.line}: body.{param}: {reason}"
    return request


def line_id(key: bytes, line: int) -> str:
    """The ``id`` of an output or error line: ``batch_req_`` and a keyed hash of its line."""
    return "batch_req_" + hmac.new(key, b"line %d" % line, hashlib.sha256).hexdigest()[:24]


def done_line(request_id: str, custom_id: str, url: str, model: str, job_id: str,
              results: Sequence[JobResult]) -> str:
    """The output line of a request whose jobs are done (``results`` in prompt order; ``job_id`` the first's)."""
    body = translate_results(results, ENDPOINTS.get(url, "completion"), model)
    return json_line({"id": request_id, "custom_id": custom_id,
                      "response": {"status_code": 200, "request_id": job_id, "body": body}, "error": None})


def failed_line(request_id: str, custom_id: str, job_id: str, status: str, error: str | None,
                error_code: str | None) -> str:
    """The error-file line of a request whose job ended ``status`` (failed, cancelled, expired)."""
    body = error_body(error or status, type_="server_error" if failure_status(error_code) >= 500 else
                      "invalid_request_error", code=error_code or status)
    return json_line({"id": request_id, "custom_id": custom_id,
                      "response": {"status_code": failure_status(error_code), "request_id": job_id, "body": body},
                      "error": None})


def invalid_line(request_id: str, request: Request) -> str:
    """The error-file line of an input line that is not a request that can run."""
    return json_line({"id": request_id, "custom_id": request.custom_id, "response": None,
                      "error": {"code": request.error_code, "message": request.error, "line": request.line}})


def unrun_line(request_id: str, custom_id: str | None, line: int, code: str, message: str) -> str:
    """The error-file line of a request the batch ended without running (``batch_expired``)."""
    return json_line({"id": request_id, "custom_id": custom_id, "response": None,
                      "error": {"code": code, "message": message, "line": line}})


def answered_custom_id(record: Any) -> str | None:
    """The custom_id an output or error line answers (None for a line that names none)."""
    if isinstance(record, dict) and isinstance(record.get("custom_id"), str):
        return record["custom_id"]
    return None
