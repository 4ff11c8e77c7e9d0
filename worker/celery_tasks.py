"""Celery messages: the task of a ``sluiceway.generate`` message (its job, its
request context, its timing options). The spellings of one Redis URL for Celery live in
``producers.connection`` (``celery_target``)."""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from producers.celery_app import TASK_NAME
from producers.connection import broker_redis_url, celery_target, celery_url  # noqa: F401  (their home before)
from producers.protocol import PROTOCOL_VERSION, Job, describe_validation_error
from producers.protocol.keys import MAX_ID_LENGTH

_PROTOCOL_ID = re.compile(r"[A-Za-z0-9._:@-]{1,%d}" % MAX_ID_LENGTH)
EMBED_FIELDS = ("callbacks", "errbacks", "chain", "chord")  # the canvas a protocol 2 body carries


@dataclass
class CeleryTask:
    """One ``sluiceway.generate`` message, read: its job and what Celery's worker would know of it."""

    task_id: str  # Celery's id, any string; the job id is ``job_id(task_id)``
    job: Job
    request: dict  # the request context, as Celery's worker builds it (``celery.app.task.Context``)
    eta: float | None = None  # unix seconds: not to start before
    expires: float | None = None  # unix seconds: revoked if not started by then
    time_limit: float | None = None  # seconds of running: hard limit
    soft_time_limit: float | None = None

    @property
    def ignore_result(self) -> bool:
        """Sent with ``ignore_result``: no state of it is stored; its canvas still fires (as in Celery)."""
        return bool(self.request.get("ignore_result"))

    def expired(self, now: float | None = None) -> bool:
        return self.expires is not None and (now or time.time()) >= self.expires

    def limit(self) -> tuple[float, str] | None:
        """The nearer of the two time limits and its name, or None."""
        limits = [(s, n) for s, n in ((self.soft_time_limit, "soft_time_limit"), (self.time_limit, "time_limit")) if s]
        return min(limits) if limits else None


class TaskRefused(ValueError):
    """A message that is no job; ``request`` is its context when it could be read (its end fires its canvas)."""

    def __init__(self, message: str, request: dict | None = None) -> None:
        super().__init__(message)
        self.request = request


def job_id(task_id: str) -> str:
    """The protocol id of a Celery task id: itself when the protocol allows it, else a digest of it.

    NOTE: Celery allows any string; protocol ids are ``[A-Za-z0-9._:@-]{1,128}``. The digest is
    stable, so a revoke of the Celery id reaches the same job.
    """
    if _PROTOCOL_ID.fullmatch(task_id):
        return task_id
    return "celery-" + hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).hexdigest()[:48]


def _when(value: Any, name: str) -> float | None:
    if value in (None, ""):
        return None
    try:
        moment = datetime.fromisoformat(str(value))
    except ValueError:
        raise ValueError(f"{name}: not an ISO 8601 time: {str(value)[:64]!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)  # NOTE: Celery sends UTC (enable_utc is its default)
    return moment.timestamp()


def as_protocol_2(body: Any, headers: dict) -> tuple[Any, dict]:
    """A protocol 1 message's body and headers in protocol 2's form; any other message's as they are.

    NOTE: Celery's worker still takes protocol 1 (an app's ``task_protocol = 1``): the headers
    name no task, and the body is one mapping of the task's name, id, options, args and kwargs.
    """
    if "task" in headers or not isinstance(body, dict) or "task" not in body:
        return body, headers
    embed = {name: body.get(name) for name in ("callbacks", "errbacks", "chord")}
    options = {k: v for k, v in body.items() if k not in ("args", "kwargs", *embed)}
    return [body.get("args"), body.get("kwargs"), embed], {**headers, **options}


def read_task(task_id: str, body: Any, message: Any, hostname: str, headers: dict) -> CeleryTask:
    """The task of a Celery message, its body and ``headers`` in protocol 2's form (``as_protocol_2``);
    ``TaskRefused`` names the problem, whatever the message."""
    try:
        return _read_task(task_id, body, message, hostname, headers)
    except TaskRefused:
        raise
    except Exception as exc:  # NOTE: a last guard: an unforeseen message fails its task, not the ingress's round
        raise TaskRefused(f"the message could not be read: {type(exc).__name__}: {str(exc)[:200]}") from None


def read_request(body: Any, message: Any, hostname: str, headers: dict) -> dict:
    """The request context of a message, its body and ``headers`` in protocol 2's form, as Celery's
    worker builds it (``celery.app.task.Context``); read from whatever the body holds, so a task
    refused for its name or its arguments still ends in its chord, chain and errbacks."""
    args, kwargs, embed = body if isinstance(body, (list, tuple)) and len(body) == 3 else ((), {}, {})
    embed = embed if isinstance(embed, dict) else {}
    properties = dict(message.properties or {})
    delivery = message.delivery_info or {}
    return {**headers, "properties": properties, "reply_to": properties.get("reply_to"),
            "correlation_id": properties.get("correlation_id"), "hostname": hostname, "is_eager": False,
            "args": list(args) if isinstance(args, (list, tuple)) else [],
            "kwargs": dict(kwargs) if isinstance(kwargs, dict) else {},
            "delivery_info": {"exchange": delivery.get("exchange"), "routing_key": delivery.get("routing_key"),
                              "priority": properties.get("priority"),
                              "redelivered": bool(delivery.get("redelivered"))},
            **{name: embed.get(name) for name in EMBED_FIELDS}}


def _read_task(task_id: str, body: Any, message: Any, hostname: str, headers: dict) -> CeleryTask:
    request = read_request(body, message, hostname, headers)
    if not (isinstance(body, (list, tuple)) and len(body) == 3):
        raise TaskRefused("the message body is not a Celery protocol 2 body [args, kwargs, embed]", request)
    args, kwargs, _ = body
    # NOTE: Celery's client refuses both before sending; a client in another language may not
    if not isinstance(args, (list, tuple, type(None))):
        raise TaskRefused(f"args: expected a list, got {type(args).__name__}", request)
    if not isinstance(kwargs, (dict, type(None))):
        raise TaskRefused(f"kwargs: expected a mapping, got {type(kwargs).__name__}", request)
    try:
        limits = headers.get("timelimit") or (None, None)
        hard, soft = (float(x) if x else None for x in (list(limits) + [None, None])[:2])
        return CeleryTask(task_id, task_job(job_id(task_id), body), request, eta=_when(headers.get("eta"), "eta"),
                          expires=_when(headers.get("expires"), "expires"), time_limit=hard, soft_time_limit=soft)
    except (TypeError, ValueError) as exc:
        raise TaskRefused(str(exc), request) from None


def task_job(job_id: str, body: Any) -> Job:
    """The job of a Celery (protocol 2) body ``[args, kwargs, embed]``; ``ValueError`` names the problem."""
    if not (isinstance(body, (list, tuple)) and len(body) == 3):
        raise ValueError("the message body is not a Celery protocol 2 body [args, kwargs, embed]")
    args, kwargs, _ = body
    kwargs = dict(kwargs or {})
    if args:
        if len(args) == 1 and "prompt" in kwargs:
            raise ValueError(f"prompt: given by name and as the positional argument (a {type(args[0]).__name__}); "
                             "a chain step or callback gets the previous result as that argument: make its "
                             "signature immutable (.si(), or .set(immutable=True))")
        if len(args) != 1:
            raise ValueError(f"{TASK_NAME} takes one positional argument (the prompt), got {len(args)}")
        kwargs["prompt"] = args[0]
    for name in ("id", "v", "stream"):
        if name in kwargs:
            raise ValueError(f"{name}: not a {TASK_NAME} argument (the task id is the job id)")
    try:
        # NOTE: stream=True makes the step loop hand deltas over; they become PROGRESS states
        # (a scoring job generates none)
        streamed = kwargs.get("score") is None
        return Job.model_validate({**kwargs, "v": PROTOCOL_VERSION, "id": job_id, "stream": streamed})
    except ValidationError as exc:
        raise ValueError(describe_validation_error(exc)) from None
