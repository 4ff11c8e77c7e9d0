"""``sluiceway worker``: one click option per ``WorkerSettings`` field, each also ``SLUICEWAY_<FLAG>``."""

from __future__ import annotations

import errno
import signal
import socket
import sys
import typing
from typing import Any

import click

from producers.service_settings import load_settings as _load, redis_url_for, settings_options
from worker.settings import WorkerSettings

if typing.TYPE_CHECKING:
    from worker.engine_host import EngineLike


def load_settings(flags: dict[str, Any]) -> WorkerSettings:
    """Settings from the given flags over the environment; a usage error names the flag."""
    return _load(WorkerSettings, flags)


def run_worker(settings: WorkerSettings, engine: "EngineLike | None" = None) -> int:
    """Run a worker in this process until SIGTERM/SIGINT; return its exit code."""
    from redis.exceptions import RedisClusterException

    from producers.connection import UnsupportedServer
    from worker.heartbeat import NameInUse
    from worker.loop import Worker

    def give_up(signum, _frame):  # while the engine loads: unwind, so a private Redis is stopped too
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, give_up)
    with redis_url_for(settings.redis, "worker") as url:
        try:
            worker = Worker(settings, engine=engine, redis_url=url)
        except RedisClusterException as exc:  # NOTE: redis-py's cluster client connects when made
            click.echo(f"error: redis: {exc}", err=True)
            return 2
        except ValueError as exc:  # a setting the worker's parts refuse, named by the message
            click.echo(f"error: {exc}", err=True)
            return 2
        worker.install_signal_handlers()
        try:
            code = worker.work()
        except (NameInUse, UnsupportedServer) as exc:
            click.echo(f"error: {exc}", err=True)
            return 2
        if worker.refusal is not None:  # refused once a Redis that was away answered
            click.echo(f"error: {worker.refusal}", err=True)
        return code


def _metrics_unlistenable(host: str, port: int | None) -> str | None:
    """Why the metrics endpoint cannot listen on ``host:port``, naming the setting, or None.

    NOTE: asked before the engine loads (minutes on a GPU): the endpoint itself starts after it,
    and a port taken or a host that does not resolve ended the worker there with a traceback.
    The probe binds the address prometheus_client's server would (the first the host resolves
    to, with SO_REUSEADDR) and lets go of it."""
    if port is None or port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        return f"metrics_host: {host!r} cannot be resolved ({exc.strerror})"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):  # taken, or below 1024 without the right
                return f"metrics_port: cannot bind to {port} on {address[0]} ({exc.strerror})"
            return f"metrics_host: cannot bind to {host!r} ({exc.strerror})"
    return None


def _check_celery_config(config: str) -> None:
    """ValueError when ``config`` does not load; nothing when celery is not installed (the worker
    then says so and runs without it)."""
    try:
        from worker.celery_ingress import load_celery_config

        load_celery_config(config)  # NOTE: its own ImportErrors (a missing module) come out as ValueError
    except ImportError:  # celery itself
        return


@click.command("worker", context_settings={"max_content_width": 110})
@settings_options(WorkerSettings)
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
    unusable = _metrics_unlistenable(settings.metrics_host, settings.metrics_port)
    if unusable:
        click.echo(f"error: {unusable}", err=True)
        sys.exit(2)
    from engine.config import EngineArgs
    from worker.logs import configure

    try:
        EngineArgs(**settings.engine_kwargs())
        if settings.celery and settings.celery_config:  # named now, not after the model has loaded
            _check_celery_config(settings.celery_config)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    configure(settings.log_level, settings.log_format)
    sys.exit(run_worker(settings))


def main() -> None:
    worker_command(prog_name="sluiceway worker")

