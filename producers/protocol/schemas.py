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
from producers.protocol.job import ProtocolError, describe_validation_error
from producers.protocol.statuses import Status


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class Timings(BaseModel):
    queue_s: float | None = None  # enqueued -> admitted into the engine
    ttft_s: float | None = None  # admitted -> first token
    total_s: float | None = None  # enqueued -> finished


class Completion(BaseModel):
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list[dict[str, float]] | None = None  # per token: {token_id: logprob}


class JobResult(BaseModel):
    """The ``result`` field of a finished job's hash."""

    id: str
    text: str  # the first completion's text
    outputs: list[Completion]
    usage: Usage
    metadata: dict[str, Any] = Field(default_factory=dict)
    timings: Timings = Field(default_factory=Timings)


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


class TokenDelta(BaseModel):
    """One entry of a streamed job's ``{prefix}:tokens:{id}`` stream.

    Stored as flat stream fields: ``index``, ``offset`` (v1.1), ``text``, ``token_ids`` (a
    JSON array) and, on the last entry of a completion, ``finish_reason``. A job that ends
    without finishing normally (cancelled, failed, expired) gets a last entry whose
    ``finish_reason`` is that status. ``offset`` is the number of tokens of that completion
    before this entry's: a reader places each entry there and drops what it already has
    (``producers.deltas.ExactDeltas``); entries of v1 writers have none.
    """

    index: int = 0  # which completion, for n > 1
    offset: int | None = None  # tokens of this completion before this entry (None: a v1 writer's entry)
    text: str = ""  # text new since the completion's previous entry
    token_ids: list[int] = Field(default_factory=list)  # tokens new since the previous entry
    finish_reason: str | None = None

    def to_fields(self) -> dict[str, str]:
        fields = {"index": str(self.index)}
        if self.offset is not None:
            fields["offset"] = str(self.offset)
        fields.update(text=self.text, token_ids=json.dumps(self.token_ids))
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
            )
        except (ValueError, ValidationError) as exc:
            raise ProtocolError(f"bad tokens entry {data!r}: {exc}") from None


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

    def alive(self, now: float) -> bool:
        return now - self.last_seen <= self.stale_after_s

