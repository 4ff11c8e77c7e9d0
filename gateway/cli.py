"""``sluiceway serve``: one click option per ``GatewaySettings`` field, each also ``SLUICEWAY_<FLAG>``."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from typing import Any

import click

from gateway.settings import GatewaySettings
from producers.connection import UnsupportedServer, check_cluster_layout
from producers.service_settings import load_settings as _load, redis_url_for, settings_options


def load_settings(flags: dict[str, Any]) -> GatewaySettings:
    """Settings from the given flags over the environment; a usage error names the flag."""
    return _load(GatewaySettings, flags)


@click.command("serve", context_settings={"max_content_width": 110})
@settings_options(GatewaySettings, repeated=("api_key", "tenant_max_outstanding", "tool_call_parser"))
def serve_command(**flags: Any) -> None:
    """Serve the OpenAI API (completions, chat, models) over the queues the workers drain.

    Each request becomes one job on the queue of its model (the models live workers
    advertise with --served-model-name); the answer comes from the job's result or, with
    "stream": true, from its token stream. Stateless: run as many as you like on one Redis.
    Every flag can also be set as SLUICEWAY_<FLAG> (for example SLUICEWAY_API_KEY=k1,k2);
    flags win.
    """
    import uvicorn

    from gateway.app import create_app

    settings = load_settings(flags)
    try:  # NOTE: said once here, for every process of --workers, not at each one's first request
        check_cluster_layout(settings.redis or "", settings.queue_shards)
    except UnsupportedServer as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    unusable = _unlistenable(settings.host, settings.port)
    if unusable:
        click.echo(f"error: {unusable}", err=True)
        sys.exit(2)
    _raise_open_files_limit()
    # NOTE: uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again to
    # the handler it found: this one, so the private Redis is stopped and the exit code is 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with redis_url_for(settings.redis, "serve", "start workers with --redis {url}") as url:
        settings = settings.model_copy(update={"redis": url})
        try:
            _check_server(url, settings.queue_shards)
        except UnsupportedServer as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except ValueError as exc:  # a URL redis-py cannot open (an unknown scheme, a bad port, ...)
            click.echo(f"error: redis: {exc}", err=True)
            sys.exit(2)
        click.echo(f"sluiceway serve: OpenAI API at http://{settings.host}:{settings.port}/v1"
                   f" ({len(settings.tenants) or 'no'} API keys, {settings.workers} processes,"
                   f" Redis {_redacted(url)})")
        sys.stdout.flush()
        # NOTE: no access log: one line per request costs more than the request itself here
        options = dict(host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                       access_log=False, timeout_graceful_shutdown=30)
        if settings.workers == 1:
            uvicorn.run(create_app(settings), **options)
        else:  # each process rebuilds the settings from the environment
            os.environ.update(settings.to_environment())
            uvicorn.run("gateway.app:create_app_from_environment", factory=True, workers=settings.workers, **options)


def _check_server(url: str, queue_shards: int) -> None:
    """``UnsupportedServer`` when ``url`` (a single-node URL) reaches a Redis Cluster node.

    NOTE: a Redis that does not answer yet is no reason to refuse: the gateway starts, and its
    /health answers 503 until Redis does (a cluster URL was checked before: its client connects
    when made, and the gateway's first request tells)."""
    import redis

    from producers.connection import check_server, connect, is_cluster_url

    if is_cluster_url(url):
        return
    try:
        with connect(url, socket_connect_timeout=5, socket_timeout=5) as client:
            check_server(client, queue_shards)
    except redis.RedisError:
        logging.getLogger("sluiceway.gateway").warning("redis at %s does not answer yet", _redacted(url))


def _unlistenable(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on ("host: ..." or "port: ..."), or None when it can.

    NOTE: asked before anything starts (a private Redis, the batch feeder): uvicorn finds out
    only after its startup, exits 3 with its own message, and its shutdown may wait on a batch
    task that lost its cancel in a Redis write (``producers.cancelling``). The probe binds every address the host
    resolves to, with SO_REUSEADDR, as uvicorn's listener does, and lets go of them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"host: {host!r} cannot be resolved ({exc.strerror})"
    with contextlib.ExitStack() as bound:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                probe = bound.enter_context(socket.socket(family, kind, proto))
            except OSError:  # a family this kernel does not have (IPv6 turned off): skipped, as asyncio does
                continue
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):  # taken, or below 1024 without the right
                    return f"port: cannot bind to {port} on {address[0]} ({exc.strerror})"
                where = repr(host) if address[0] == host else f"{host!r} ({address[0]})"
                return f"host: cannot bind to {where} ({exc.strerror})"
    return None


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(0)


def _raise_open_files_limit() -> None:
    """Soft limit of open files up to the hard one: each request holds a socket and a Redis connection."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    except (ImportError, ValueError, OSError):
        pass  # not Linux/macOS, or not allowed: the system's limit stands


def _redacted(url: str) -> str:
    """``url`` without its password."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest


def main() -> None:
    serve_command(prog_name="sluiceway serve")
