"""Protocol v1's records besides the job: a result, a job's hash as a client reads it, a token
delta, a worker's heartbeat. Payloads are JSON only; nothing read from Redis is ever
unpickled or evaluated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator

from producers.protocol.error_codes import ErrorCode, error_code_of
from producers.protocol.job import ProtocolError
from producers.protocol.validation_errors import describe_validation_error
from producers.protocol.score import ContinuationScore
from producers.protocol.statuses import Status


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class Timings(BaseModel):
    queue_s: float | None = None  # enqueued -> admitted into the engine
    ttft_s: float | None = None  # admitted -> first token
    total_s: float | None = None  # enqueued -> finished
    # where the wait before the first token went, each from enqueued (null when unknown)
    read_s: float | None = None  # -> read from its queue by the worker
    ready_s: float | None = None  # -> its prompt ready as token ids (tokenized, or given so)
    scheduled_s: float | None = None  # -> its first tokens scheduled in an engine step
    launched_s: float | None = None  # -> that step launched on the device (v1.2)


class TokenText(BaseModel):
    """A token with its own text: ``token`` is the token decoded on its own (U+FFFD for part of
    a multi-byte character), ``bytes`` its exact bytes either way."""

    token_id: int
    token: str
    bytes: list[int]


class TokenLogprob(TokenText):
    """One token's logprob with its text, as the OpenAI API returns it (v1.2)."""

    logprob: float  # -9999.0 stands for minus infinity (a token that cannot be chosen)
    rank: int  # 1 = the most likely token


class TopLogprobs(TokenLogprob):
    """A token's logprob and the ``k`` most likely tokens at its place, most likely first."""

    top: list[TokenLogprob] = Field(default_factory=list)


class Completion(BaseModel):
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list[dict[str, float]] | None = None  # per token: {token_id: logprob}
    top_logprobs: list[TopLogprobs] | None = None  # v1.2, with sampling.logprobs: one per token


class JobResult(BaseModel):
    """The ``result`` field of a finished job's hash."""

    id: str
    text: str  # the first completion's text
    outputs: list[Completion]
    usage: Usage
    metadata: dict[str, Any] = Field(default_factory=dict)
    timings: Timings = Field(default_factory=Timings)
    # v1.2, with sampling.prompt_logprobs: one per prompt token, null first
    prompt_logprobs: list[TopLogprobs | None] | None = None
    scores: list[ContinuationScore] | None = None  # v1.2: a scoring job's, one per continuation
    # v1.4, with sampling.prompt_logprobs: the prompt as text (a text prompt as given, else its
    # tokens decoded) and its first token, which prompt_logprobs' null first entry leaves unnamed
    prompt_text: str | None = None
    prompt_first_token: TokenText | None = None


def _text(value: bytes | str | None) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


class JobStatus(BaseModel):
    """A job's hash as a client sees it (everything but the result)."""

    id: str
    status: Status
    attempts: int = 0
    worker: str | None = None
    queue: str | None = None
    enqueued_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    error_code: ErrorCode | str | None = None  # every end but done has one; a code this client does not know stays text

    @field_validator("error_code", mode="before")
    @classmethod
    def _error_code(cls, value: Any) -> ErrorCode | str | None:
        return error_code_of(value)

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    @classmethod
    def from_hash(cls, job_id: str, fields: Mapping[Any, Any]) -> "JobStatus":
        """Build from an HGETALL reply (bytes or str); unknown fields are ignored."""
        data = {_text(k): _text(v) for k, v in fields.items()}
        known = {name: data[name] for name in cls.model_fields if data.get(name) not in (None, "")}
        try:
            return cls.model_validate({**known, "id": job_id})
        except ValidationError as exc:
            raise ProtocolError(f"job hash of {job_id}: {describe_validation_error(exc)}", job_id) from None


PROMPT_FIELDS = {"prompt_text", "prompt_first_token", "prompt_logprobs"}  # a token entry's ``prompt`` (v1.4)


class TokenDelta(BaseModel):
    """One entry of a streamed job's ``{prefix}:tokens:{id}`` stream.

    Stored as flat stream fields: ``index``, ``offset`` (v1.1), ``text``, ``token_ids`` (a
    JSON array), ``logprobs`` (v1.2, a JSON array of ``TopLogprobs``, when the job asks for
    logprobs), ``prompt`` (v1.4, a JSON object of ``prompt_text``, ``prompt_first_token`` and
    ``prompt_logprobs`` as a result holds them, on completion 0's first entry of a job that asks
    for ``sampling.prompt_logprobs``) and, on the last entry of a completion, ``finish_reason``.
    A job that ends without finishing normally (cancelled, failed, expired) gets a last entry whose
    ``finish_reason`` is that status. ``offset`` is the number of tokens of that completion
    before this entry's: a reader places each entry there and drops what it already has
    (``producers.deltas.ExactDeltas``); entries of v1 writers have none.
    """

    index: int = 0  # which completion, for n > 1
    offset: int | None = None  # tokens of this completion before this entry (None: a v1 writer's entry)
    text: str = ""  # text new since the completion's previous entry
    token_ids: list[int] = Field(default_factory=list)  # tokens new since the previous entry
    finish_reason: str | None = None
    logprobs: list[TopLogprobs] | None = None  # v1.2, with sampling.logprobs: one per entry of token_ids
    # v1.4, on completion 0's first entry of a job with sampling.prompt_logprobs: the result's fields
    prompt_text: str | None = None
    prompt_first_token: TokenText | None = None
    prompt_logprobs: list[TopLogprobs | None] | None = None

    def to_fields(self) -> dict[str, str]:
        fields = {"index": str(self.index)}
        if self.offset is not None:
            fields["offset"] = str(self.offset)
        fields.update(text=self.text, token_ids=json.dumps(self.token_ids))
        if self.logprobs is not None:
            fields["logprobs"] = json.dumps([lp.model_dump() for lp in self.logprobs], ensure_ascii=False)
        if self.prompt_text is not None:
            fields["prompt"] = self.model_dump_json(include=PROMPT_FIELDS)
        if self.finish_reason is not None:
            fields["finish_reason"] = self.finish_reason
        return fields

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> "TokenDelta":
        data = {_text(k): _text(v) for k, v in fields.items()}
        try:
            return cls(
                index=int(data.get("index") or 0),
                offset=int(data["offset"]) if data.get("offset") else None,
                text=data.get("text") or "",
                token_ids=json.loads(data.get("token_ids") or "[]"),
                finish_reason=data.get("finish_reason") or None,
                logprobs=json.loads(data["logprobs"]) if data.get("logprobs") else None,
                **_prompt_of(data.get("prompt")),
            )
        except (ValueError, ValidationError) as exc:
            raise ProtocolError(f"bad tokens entry {data!r}: {exc}") from None


def _prompt_of(value: str | None) -> dict[str, Any]:
    """A token entry's ``prompt`` field as TokenDelta's fields (fields it does not know ignored)."""
    if not value:
        return {}
    found = json.loads(value)
    if not isinstance(found, dict):
        raise ValueError(f"prompt must be a JSON object, got {type(found).__name__}")
    return {k: v for k, v in found.items() if k in PROMPT_FIELDS}


class WorkerInfo(BaseModel):
    """One worker's heartbeat: the JSON value of its field in the ``{prefix}:workers`` hash.

    A worker rewrites its field every few seconds and deletes it on a clean exit. A field
    whose ``last_seen`` is older than ``stale_after_s`` belongs to a worker that died.
    """

    name: str
    host: str
    pid: int
    queues: list[str]
    model: str
    state: Literal["starting", "running", "draining"] = "running"
    started_at: float  # unix seconds
    last_seen: float  # unix seconds
    stale_after_s: float  # the heartbeat is missed for good after this long
    in_flight: int = 0  # jobs held (read and not yet acknowledged)
    capacity: int = 0  # jobs the engine could take right now
    admitted: int = 0  # jobs started since the worker started
    finished: int = 0  # jobs ended (any terminal status) since the worker started
    version: str = ""
    protocol: str | None = None  # the protocol revision it speaks ("1.1"); None: a worker from before 1.1
    result_ttl_s: int | None = None  # seconds it keeps an ended job's keys (its --result-ttl)
    # the name the OpenAI gateway serves its model under (--served-model-name; default: its model);
    # None: a worker from before the gateway
    served_model_name: str | None = None
    # the Celery queue it consumes (--celery-queue); None: it consumes none (--no-celery, no celery
    # package, a cluster without --celery-broker), or a worker from before the field
    celery_queue: str | None = None

    def alive(self, now: float) -> bool:
        return now - self.last_seen <= self.stale_after_s

