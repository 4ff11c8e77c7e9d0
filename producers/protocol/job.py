"""Protocol v1's job object: its schema, its limits and ``parse_job`` (see PROTOCOL.md).

A job is plain JSON; nothing read from Redis is ever unpickled or evaluated. ``parse_job``
turns any bytes into a ``Job`` or a ``ProtocolError`` that names the bad field.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticSerializationError

from engine.sampling_params import SamplingParams
from producers.protocol import limits
from producers.protocol.keys import check_job_id
from producers.protocol.revisions import LATER_FIELDS, LATER_MESSAGE_FIELDS
from producers.protocol.sampling_types import SAMPLING_CHECKS, _is_int, check_sampling_types
from producers.protocol.score import Score
from producers.protocol.tools import Tool, ToolCall, ToolsError, check_tools
from producers.protocol.validation_errors import describe_validation_error, json_type, sampling_error
from producers.protocol.limits import (
    MAX_ENTRY_BYTES,
    MAX_MESSAGES,
    MAX_METADATA_BYTES,
    MAX_PROMPT_BYTES,
    MAX_PROMPT_TOKEN_IDS,
    abbreviate,
    check_size,
    utf8_len,
)

PROTOCOL_VERSION = 1  # the job's ``v``: a worker runs jobs of this major version
SAMPLING_DEFAULTS = SamplingParams().to_dict()  # a sampling field at its default is left out of the wire


# NOTE: strict everywhere: every field must have its exact JSON type, with no coercion ("5" is
# not an integer, "yes" not a boolean, 5.0 not an integer); an integer is a number, as in JSON.
class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None  # v1.3: the calls an assistant message made
    tool_call_id: str | None = None  # v1.3: the call a tool message answers
    # null (or absent) only on an assistant message with tool_calls (v1.3)
    content: str | None = Field(None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, value: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message makes tool calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("role") != "tool":
            raise ValueError("only a tool message answers a tool call")
        return value

    @field_validator("content")
    @classmethod
    def _content(cls, value: str | None, info: ValidationInfo) -> str | None:
        if "tool_calls" not in info.data:  # refused itself: said already
            return value
        if value is None and not (info.data.get("role") == "assistant" and info.data["tool_calls"]):
            raise ValueError("missing: a string (null or absent only on an assistant message with tool_calls)")
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template takes it: the fields given, none of the nulls (a
        template tests ``'tool_calls' in message``, which a null would pass)."""
        return self.model_dump(exclude_none=True)


class Job(BaseModel):
    """One stream entry's ``job`` field. Every size is bounded (``producers.protocol.limits``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

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
    score: Score | None = None  # v1.2: log-likelihoods of continuations instead of generation (score.py)
    tools: list[Tool] | None = None  # v1.3: functions the chat template shows the model (tools.py)

    # NOTE: the "before" checks run on the raw data, ahead of pydantic's own coercion and of
    # building SamplingParams, so an oversized list or string costs a length check, no more.
    @model_validator(mode="before")
    @classmethod
    def _plain_json(cls, data: Any) -> Any:
        if isinstance(data, dict):
            limits.check_tree(data)
        return data

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return check_job_id(value)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_size(cls, value: Any) -> Any:
        if isinstance(value, str) and utf8_len(value) > MAX_PROMPT_BYTES:
            check_size(f"{abbreviate(value)} is", utf8_len(value), MAX_PROMPT_BYTES, "MAX_PROMPT_BYTES",
                       "bytes in UTF-8, which")
        return value

    @field_validator("prompt_token_ids", mode="before")
    @classmethod
    def _token_ids_size(cls, value: Any) -> Any:
        if isinstance(value, list):
            check_size("", len(value), MAX_PROMPT_TOKEN_IDS, "MAX_PROMPT_TOKEN_IDS", "token ids")
        return value

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_size(cls, value: Any) -> Any:
        if isinstance(value, list):
            check_size("", len(value), MAX_MESSAGES, "MAX_MESSAGES", "messages")
            size = sum(utf8_len(text) for m in value for text in _message_texts(m))
            check_size("content of", size, MAX_PROMPT_BYTES, "MAX_PROMPT_BYTES", "bytes in UTF-8 (all messages), which")
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[Tool] | None) -> list[Tool] | None:
        try:
            return value if value is None else check_tools(value)
        except ToolsError as exc:
            raise sampling_error(exc.place, exc.detail) from None

    @field_validator("sampling", mode="before")
    @classmethod
    def _sampling_limits(cls, value: Any) -> Any:
        if isinstance(value, dict):
            check_sampling_types(value)
        try:
            limits.check_sampling_limits(value)
        except ValueError as exc:  # "n: ...", "stop.3: ...": the place comes first
            place, _, detail = str(exc).partition(": ")
            raise sampling_error(place, detail) from None
        return value

    @field_validator("sampling")
    @classmethod
    def _sampling(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            return SamplingParams.from_dict(value).to_dict()
        except ValueError as exc:  # SamplingParams' messages start with the field's name
            message = str(exc)
            # "top_p", "structured_outputs.json.type", or "logit_bias[7]" (named as logit_bias)
            name = message.split(" ", 1)[0].rstrip(":,").split("[", 1)[0]
            known = name.split(".", 1)[0] in SAMPLING_CHECKS
            if known and "." in name or message.startswith(f"{name}: "):  # it names its place: keep the detail
                message = message.split(": ", 1)[-1]
            raise sampling_error(name if known else "", message) from None

    @field_validator("prompt_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value and min(value) < 0:
            raise ValueError("prompt_token_ids must hold non-negative integers")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value: dict[str, Any]) -> dict[str, Any]:
        # NOTE: sized as pydantic writes it (a datetime, a set, a UUID become JSON); a value it
        # cannot write (a client's object()) is refused here, not when the job is written
        try:
            text = pydantic_core.to_json(value)
        except PydanticSerializationError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        check_size("", len(text), MAX_METADATA_BYTES, "MAX_METADATA_BYTES", "bytes of JSON")
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
        if self.tools is not None and self.messages is None:
            raise ValueError("tools: only a chat job (messages) shows the model tools")
        if self.score is not None and self.stream:
            raise ValueError("stream: a scoring job (score) generates no tokens to stream; give stream false")
        # NOTE: sampling holds every field once validated (none when left out): a scoring job's must be the defaults
        if self.score is not None and self.sampling not in ({}, SamplingParams().to_dict()):
            raise ValueError("sampling: a scoring job (score) samples nothing; leave sampling out")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """A chat job's messages as its chat template takes them."""
        return [m.for_template() for m in self.messages or []]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """A chat job's tools as its chat template takes them (``tools=``), or None."""
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def sampling_params(self) -> SamplingParams:
        return SamplingParams.from_dict(self.sampling)

    def to_json(self) -> str:
        # NOTE: a later revision's fields (v1.2's score, v1.3's tools and tool calls) are written only
        # where given: a job without them is one an earlier worker reads. A worker refuses a field it
        # does not know, and written as null, score made every job of a 1.2 producer one a 1.1
        # worker refused. Sampling fields likewise: one at its default is left to the worker's
        # default (1.1's first workers knew 16 of today's 26, and refused a job naming any other)
        exclude: dict[str, Any] = {name: True for name in LATER_FIELDS if getattr(self, name) is None}
        at_default = {name for name, value in self.sampling.items()
                      if name in SAMPLING_DEFAULTS and _same(value, SAMPLING_DEFAULTS[name])}
        if at_default:
            exclude["sampling"] = at_default
        if self.messages is not None:
            plain = {i: set(LATER_MESSAGE_FIELDS) for i, m in enumerate(self.messages)
                     if m.tool_calls is None and m.tool_call_id is None}
            exclude["messages"] = plain
        return self.model_dump_json(exclude_none=False, exclude=exclude)


def _same(value: Any, default: Any) -> bool:
    """Whether ``value`` is ``default``, its JSON type too (an integer 1 for a float default is written)."""
    return type(value) is type(default) and value == default


def _message_texts(message: Any) -> list[str]:
    """The text a raw message carries: its content and its tool calls' arguments (``MAX_PROMPT_BYTES``)."""
    if isinstance(message, ChatMessage):
        message = message.model_dump()
    if not isinstance(message, dict):
        return []
    calls = message.get("tool_calls")
    functions = [c.get("function") for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
    texts = [f.get("arguments") for f in functions if isinstance(f, dict)]
    return [t for t in [message.get("content"), *texts] if isinstance(t, str)]


class ProtocolError(ValueError):
    """An entry that is not a valid v1 job; ``job_id`` is set when an id could be read."""

    def __init__(self, message: str, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


def parse_job(raw: bytes | str) -> Job:
    """Parse a stream entry's ``job`` value; raise ``ProtocolError`` naming the bad field.

    Never raises anything else, whatever the bytes. The id is read whenever it can be, so
    the job ends ``failed`` rather than staying ``queued``: bytes that are not UTF-8 are
    kept (a lossless decode) and reported as an error of the string that holds them, a
    number that cannot be a value (too many digits, NaN, ``1e999``) as an error of its
    field, and an entry too large, too deep or not JSON at all is scanned for a top-level
    ``"id"`` string (``limits.scan_id``) without being parsed.
    """
    try:
        return _parse_job(raw)
    except ProtocolError:
        raise
    except Exception as exc:  # NOTE: a last guard: no entry may ever escape the intake as another type
        raise ProtocolError(f"job could not be read: {type(exc).__name__}: {abbreviate(str(exc), 200)}") from None


def _parse_job(raw: bytes | str) -> Job:
    size = len(raw) if isinstance(raw, (bytes, bytearray)) else utf8_len(raw)
    if size > MAX_ENTRY_BYTES:
        head = _decode(raw[: limits.ID_SCAN_CHARS])
        raise ProtocolError(f"job is {size:,} bytes; the limit is {MAX_ENTRY_BYTES:,} (MAX_ENTRY_BYTES)",
                            _readable_id(limits.scan_id(head)))
    text = _decode(raw)
    problem = limits.structure_problem(text)
    if problem is not None:
        raise ProtocolError(f"job: {problem}", _readable_id(limits.scan_id(text)))
    try:
        data = limits.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"job is not valid UTF-8 JSON: {exc}", _readable_id(limits.scan_id(text))) from None
    if not isinstance(data, dict):
        raise ProtocolError(f"job must be a JSON object, got {type(data).__name__}")
    job_id = _readable_id(data.get("id"))
    if "v" not in data:
        raise ProtocolError(f"v: missing; it is the protocol version, {PROTOCOL_VERSION}", job_id)
    version = data["v"]
    if not _is_int(version):
        raise ProtocolError(f"v: expected an integer, got {json_type(version)}", job_id)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"v: unsupported protocol version {abbreviate(version)} (this worker speaks {PROTOCOL_VERSION})",
            job_id,
        )
    try:
        return Job.model_validate(data)
    except ValidationError as exc:
        raise ProtocolError(describe_validation_error(exc), job_id) from None


def _decode(raw: bytes | str) -> str:
    """Text of an entry; bytes that are not UTF-8 survive as lone surrogates (``check_tree`` names them)."""
    if isinstance(raw, str):
        return raw
    return bytes(raw).decode("utf-8", errors="surrogateescape")


def _readable_id(value: Any) -> str | None:
    try:
        return check_job_id(value)
    except ValueError:
        return None
