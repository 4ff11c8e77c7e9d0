"""What the long-running services (``sluiceway worker``, ``sluiceway serve``) share about their
settings: the Redis fields, one click option per settings field, reading flags over the
environment, and the private redis-server started when no ``--redis`` is given.

Each service's settings class derives from ``RedisFields`` (``worker/settings.py``,
``gateway/settings.py``), so ``--redis``, ``--prefix``, ``--queue-shards`` and ``--log-level``
mean the same on both, and ``SLUICEWAY_<FLAG>`` sets each. The producer commands
(``producers/cli.py``) take the same ``--queue-shards`` (``MAX_QUEUE_SHARDS``, ``QUEUE_SHARDS_HELP``).

Needs ``pydantic-settings`` (the worker's and the gateway's extra); imports no torch.
"""

from __future__ import annotations

import contextlib
import sys
import types
import typing
from collections.abc import Callable, Collection, Iterator
from typing import Any

import click
from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from producers.protocol import DEFAULT_PREFIX, Keys
from producers.protocol.keys import MAX_QUEUE_SHARDS, QUEUE_SHARDS_HELP

ENV_PREFIX = "SLUICEWAY_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class RedisFields(BaseSettings):
    """The settings every service has: where Redis is, the key prefix, the layout, the log level."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    redis: str | None = Field(
        None, validation_alias=AliasChoices("redis", "SLUICEWAY_REDIS", "SLUICEWAY_REDIS_URL"),
        description="Redis URL (redis://, rediss://, unix://, redis+sentinel://host:port,host:port/service/db,"
                    " redis+cluster://host:port,host:port with --queue-shards); unset: start a private"
                    " redis-server (also read from SLUICEWAY_REDIS_URL, as the producer commands do)")
    prefix: str = Field(DEFAULT_PREFIX, description="key prefix shared by the workers, producers and gateways")
    queue_shards: int = Field(0, ge=0, le=MAX_QUEUE_SHARDS, description=QUEUE_SHARDS_HELP)
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")

    @field_validator("log_level")
    @classmethod
    def _check_level(cls, value: str) -> str:
        if value.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {value!r}")
        return value.upper()

    @model_validator(mode="after")
    def _check_prefix(self) -> "RedisFields":
        Keys(self.prefix, self.queue_shards)  # raises on a bad prefix
        return self

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix, self.queue_shards)


def click_type(annotation: Any) -> Any:
    """The click type of a settings field's annotation (``X | None`` as ``X``; tuples comma-separated)."""
    kind = annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None -> X
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if typing.get_origin(kind) is typing.Literal:
        return click.Choice(typing.get_args(kind))
    return {bool: bool, int: click.INT, float: click.FLOAT}.get(kind, click.STRING)


def default_text(field: FieldInfo) -> str | None:
    """A field's default as its flag is written (``on``/``off`` for a switch, a list comma-joined),
    or None where there is nothing to show: no default, an empty one, or a description that
    already says it.

    NOTE: the options themselves default to None (unset: the settings, with the environment
    under the flags, decide), so click cannot show the defaults; this says them in the help."""
    if field.is_required() or "default" in (field.description or ""):
        return None
    value = field.get_default(call_default_factory=True)
    if value is None or (isinstance(value, (str, list, tuple, set, dict)) and not value):
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(getattr(value, "value", value))


def settings_options(model: type[BaseSettings], repeated: Collection[str] = ()) -> Callable:
    """A decorator adding one option per field of ``model`` (``--flag`` / ``--flag/--no-flag`` for a
    bool; the fields named in ``repeated`` take the flag many times); unset options stay None."""

    def decorate(func: Callable) -> Callable:
        for name, field in reversed(list(model.model_fields.items())):
            flag = "--" + name.replace("_", "-")
            shown = default_text(field)
            help_text = f"{field.description} [{f'default: {shown}; ' if shown else ''}env: {ENV_PREFIX}{name.upper()}]"
            kind = click_type(field.annotation)
            if name in repeated:
                option = click.option(flag, name, multiple=True, help=help_text)
            elif kind is bool:
                option = click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=help_text)
            else:
                option = click.option(flag, name, type=kind, default=None, help=help_text)
            func = option(func)
        return func

    return decorate


def load_settings(model: type[BaseSettings], flags: dict[str, Any]) -> Any:
    """``model`` from the given flags over the environment; a usage error names the flag."""
    try:
        return model(**{k: v for k, v in flags.items() if v is not None and v != ()})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else ""
            message = err["msg"].removeprefix("Value error, ")
            if not name:  # a check of several fields: the one its message starts with ("prefix must ...")
                name = next((f for f in model.model_fields if message.split(" ", 1)[0].rstrip(":,") == f), "")
            where = f"--{name.replace('_', '-')} (env {ENV_PREFIX}{name.upper()})" if name else "settings"
            problems.append(f"{where}: {message}")
        raise click.UsageError("; ".join(problems)) from None


@contextlib.contextmanager
def redis_url_for(url: str | None, command: str, hint: str = "") -> Iterator[str]:
    """``url``, or the URL of a private redis-server started for this run (said on stdout as
    ``sluiceway COMMAND: ...``, followed by ``hint``) and stopped after."""
    if url:
        yield url
        return
    from producers.embedded_redis import EmbeddedRedis

    with EmbeddedRedis(appendonly=True, die_with_parent=True) as server:
        click.echo(f"sluiceway {command}: no --redis given; started a private redis-server at {server.url}"
                   + (f" ({hint.format(url=server.url)})" if hint else ""))
        sys.stdout.flush()
        yield server.url
