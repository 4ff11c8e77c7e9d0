"""``sluiceway worker``: one click option per ``WorkerSettings`` field, each also ``SLUICEWAY_<FLAG>``."""

from __future__ import annotations

import contextlib
import signal
import sys
import types
import typing
from collections.abc import Iterator
from typing import Any

import click
from pydantic import ValidationError

from worker.settings import ENV_PREFIX, WorkerSettings

if typing.TYPE_CHECKING:
    from worker.engine_host import EngineLike


def _click_type(annotation: Any) -> Any:
    kind = annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None -> X
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if typing.get_origin(kind) is typing.Literal:
        return click.Choice(typing.get_args(kind))
    if typing.get_origin(kind) is tuple:
        return click.STRING  # queues: comma-separated
    return {bool: bool, int: click.INT, float: click.FLOAT}.get(kind, click.STRING)


def _settings_options(func):
    """Decorate ``func`` with an option per settings field; unset options stay None."""
    for name, field in reversed(list(WorkerSettings.model_fields.items())):
        flag = "--" + name.replace("_", "-")
        env = ENV_PREFIX + name.upper()
        kind = _click_type(field.annotation)
        help_text = f"{field.description} [env: {env}]"
        if kind is bool:
            option = click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=help_text)
        else:
            option = click.option(flag, name, type=kind, default=None, help=help_text)
        func = option(func)
    return func


def load_settings(flags: dict[str, Any]) -> WorkerSettings:
    """Settings from the given flags over the environment; a usage error names the flag."""
    try:
        return WorkerSettings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else ""
            where = f"--{name.replace('_', '-')} (env {ENV_PREFIX}{name.upper()})" if name else "settings"
            problems.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
        raise click.UsageError("; ".join(problems)) from None


@contextlib.contextmanager
def redis_url_for(settings: WorkerSettings) -> Iterator[str]:
    """The configured Redis URL, or a private redis-server started for this run and stopped after."""
    if settings.redis:
        yield settings.redis
        return
    from worker.embedded_redis import EmbeddedRedis

    with EmbeddedRedis(appendonly=True, die_with_parent=True) as server:
        click.echo(f"sluiceway worker: no --redis given; started a private redis-server at {server.url}")
        sys.stdout.flush()
        yield server.url


def run_worker(settings: WorkerSettings, engine: "EngineLike | None" = None) -> int:
    """Run a worker in this process until SIGTERM/SIGINT; return its exit code."""
    from redis.exceptions import RedisClusterException

    from producers.connection import UnsupportedServer
    from worker.heartbeat import NameInUse
    from worker.loop import Worker

    def give_up(signum, _frame):  # while the engine loads: unwind, so a private Redis is stopped too
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, give_up)
    with redis_url_for(settings) as url:
        try:
            worker = Worker(settings, engine=engine, redis_url=url)
        except RedisClusterException as exc:  # NOTE: redis-py's cluster client connects when made
            click.echo(f"error: redis: {exc}", err=True)
            return 2
        worker.install_signal_handlers()
        try:
            return worker.work()
        except (NameInUse, UnsupportedServer) as exc:
            click.echo(f"error: {exc}", err=True)
            return 2


@click.command("worker", context_settings={"max_content_width": 110})
@_settings_options
def worker_command(**flags: Any) -> None:
    """Drain the Redis queues into the engine and write the results back.

    Celery apps can send it sluiceway.generate tasks too (queue --celery-queue): the worker
    consumes them itself, no Celery worker process, with its own Redis -- the private one
    included -- as broker and result backend unless --celery-broker / --celery-backend say
    otherwise. --no-celery turns that off.

    Every flag can also be set as an environment variable SLUICEWAY_<FLAG> (for example
    SLUICEWAY_CLAIM_IDLE_SECONDS=30); flags win. Stop with SIGTERM: in-flight jobs finish
    within --grace-period, the rest are released to other workers.
    """
    settings = load_settings(flags)
    from engine.config import EngineArgs
    from worker.logs import configure

    try:
        EngineArgs(**settings.engine_kwargs())
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    configure(settings.log_level, settings.log_format)
    sys.exit(run_worker(settings))


def main() -> None:
    worker_command(prog_name="sluiceway worker")

