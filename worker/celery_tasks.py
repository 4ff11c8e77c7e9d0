"""Celery messages and URLs: the job of a ``sluiceway.generate`` message, and the spellings
of one Redis URL for Celery (broker, result backend) and for redis-py."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from pydantic import ValidationError

from producers.celery_app import TASK_NAME
from producers.protocol import PROTOCOL_VERSION, Job, describe_validation_error


def task_job(task_id: str, body: Any, headers: dict) -> Job:
    """The job of a Celery (protocol 2) message: ``[args, kwargs, embed]``; ``ValueError`` names the problem."""
    if not (isinstance(body, (list, tuple)) and len(body) == 3):
        raise ValueError("the message body is not a Celery protocol 2 body [args, kwargs, embed]")
    args, kwargs, _ = body
    kwargs = dict(kwargs or {})
    if args:
        if len(args) != 1 or "prompt" in kwargs:
            raise ValueError(f"{TASK_NAME} takes one positional argument (the prompt), got {len(args)}")
        kwargs["prompt"] = args[0]
    for name in ("id", "v", "stream"):
        if name in kwargs:
            raise ValueError(f"{name}: not a {TASK_NAME} argument (the task id is the job id)")
    expires = headers.get("expires")
    if expires and kwargs.get("deadline") is None:
        kwargs["deadline"] = datetime.fromisoformat(expires).timestamp()
    try:
        # NOTE: stream=True makes the step loop hand deltas over; they become PROGRESS states.
        return Job.model_validate({**kwargs, "v": PROTOCOL_VERSION, "id": task_id, "stream": True})
    except ValidationError as exc:
        raise ValueError(describe_validation_error(exc)) from None


def celery_url(redis_url: str) -> str:
    """The Celery spelling of a redis-py URL, for broker and result backend alike.

    ``unix:///path?db=N`` becomes ``redis+socket:///path?virtual_host=N``; a ``rediss://`` URL
    without ``ssl_cert_reqs`` gets ``ssl_cert_reqs=required`` -- redis-py's default, which
    Celery will not assume (its backend refuses such a URL; kombu would skip the check).
    """
    parts = urlsplit(redis_url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.scheme == "unix":
        query = [("virtual_host" if k == "db" else k, v) for k, v in query]
        return _url("redis+socket", parts.netloc, parts.path, query)
    if parts.scheme == "rediss" and not any(k == "ssl_cert_reqs" for k, _ in query):
        return _url("rediss", parts.netloc, parts.path, [*query, ("ssl_cert_reqs", "required")])
    return redis_url


def broker_redis_url(broker_url: str) -> str:
    """The redis-py spelling of a Celery Redis broker URL (``celery_url`` undone), to read queue depths."""
    parts = urlsplit(broker_url)
    if parts.scheme in ("redis+socket", "socket"):
        query = parse_qsl(parts.query, keep_blank_values=True)
        return _url("unix", parts.netloc, parts.path, [("db" if k == "virtual_host" else k, v) for k, v in query])
    return broker_url


def _url(scheme: str, netloc: str, path: str, query: list[tuple[str, str]]) -> str:
    # NOTE: not urlunsplit, which drops the empty host of "unix:///path"
    return f"{scheme}://{netloc}{path}" + (f"?{urlencode(query)}" if query else "")
