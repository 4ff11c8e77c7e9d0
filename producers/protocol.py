"""Protocol v1: the contract between producers and workers (see PROTOCOL.md).

Every Redis key name and every payload schema lives here. Payloads are JSON only; nothing
read from Redis is ever unpickled or evaluated.
"""

from __future__ import annotations

import json
import re
import secrets
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
DEFAULT_PREFIX = "sluiceway"
DEFAULT_QUEUES = ("interactive", "bulk")  # read in this order
CONSUMER_GROUP = "workers"
JOB_FIELD = "job"  # the one field of a stream entry
MAX_ID_LENGTH = 128
_ID_RE = re.compile(r"^[A-Za-z0-9._:@-]+$")


class Status(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({Status.DONE, Status.FAILED, Status.CANCELLED, Status.EXPIRED})


class Keys:
    """Every key name of protocol v1, under one prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if not prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"prefix must be a non-empty word, got {prefix!r}")
        self.prefix = prefix

    def queue(self, name: str) -> str:
        return f"{self.prefix}:queue:{name}"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def done(self, job_id: str) -> str:
        return f"{self.prefix}:done:{job_id}"

    def tokens(self, job_id: str) -> str:
        return f"{self.prefix}:tokens:{job_id}"

    def cancel(self, job_id: str) -> str:
        return f"{self.prefix}:cancel:{job_id}"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def workers(self) -> str:
        """Hash: worker name -> JSON heartbeat (host, pid, in flight, last seen)."""
        return f"{self.prefix}:workers"


def new_job_id() -> str:
    """An unguessable job id (128 random bits)."""
    return secrets.token_hex(16)


def check_job_id(job_id: Any) -> str:
    if not isinstance(job_id, str) or not job_id:
        raise ValueError(f"id must be a non-empty string, got {job_id!r}")
    if len(job_id) > MAX_ID_LENGTH:
        raise ValueError(f"id is {len(job_id)} characters long; the limit is {MAX_ID_LENGTH}")
    if not _ID_RE.match(job_id):
        raise ValueError(f"id {job_id!r} may hold only letters, digits and . _ : @ -")
    return job_id


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class Job(BaseModel):
    """One stream entry's ``job`` field."""

    model_config = ConfigDict(extra="forbid")

    v: Literal[1] = PROTOCOL_VERSION
    id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)
    priority: int = 0  # higher runs first
    deadline: float | None = None  # unix time (seconds) after which the job is expired
    stream: bool = False
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return check_job_id(value)

    @field_validator("sampling")
    @classmethod
    def _sampling(cls, value: dict[str, Any]) -> dict[str, Any]:
        return SamplingParams.from_dict(value).to_dict()

    @field_validator("prompt_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("prompt_token_ids must hold non-negative integers")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> "Job":
        given = [n for n in ("prompt", "prompt_token_ids", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "exactly one of prompt, prompt_token_ids, messages must be given"
                f" (got {', '.join(given) or 'none'})"
            )
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self

    @property
    def sampling_params(self) -> SamplingParams:
        return SamplingParams.from_dict(self.sampling)

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=False)


class ProtocolError(ValueError):
    """An entry that is not a valid v1 job; ``job_id`` is set when an id could be read."""

    def __init__(self, message: str, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


def parse_job(raw: bytes | str) -> Job:
    """Parse a stream entry's ``job`` value; raise ``ProtocolError`` naming the bad field."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"job is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"job must be a JSON object, got {type(data).__name__}")
    job_id = data.get("id")
    try:
        job_id = check_job_id(job_id)
    except ValueError:
        job_id = None
    if data.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"v: unsupported protocol version {data.get('v')!r} (this worker speaks {PROTOCOL_VERSION})",
            job_id,
        )
    try:
        return Job.model_validate(data)
    except ValidationError as exc:
        raise ProtocolError(_describe(exc), job_id) from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "job"
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


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
