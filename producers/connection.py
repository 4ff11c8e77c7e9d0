"""Opening Redis from a URL: the one place every entry point (the clients, ``sluiceway bulk`` and
the other producer commands, the worker, its Celery ingress, the gateway) turns a URL into a
connection, so a form added here works everywhere.

Accepted forms:

- ``redis://[[user]:password@]host[:port][/db][?option=value...]``, ``rediss://...`` (TLS) and
  ``unix://[[user]:password@]/path/to/socket[?db=N]``: as redis-py reads them.
- ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name[/db][?option=value...]``
  and ``rediss+sentinel://...`` (TLS to the sentinels and to the data nodes): the sentinels to ask
  (port 26379 when left out; IPv6 hosts in brackets) for the current primary of ``service_name``.
  The user and password are those of the data nodes; a sentinel that wants its own gives them as
  the options ``sentinel_username`` / ``sentinel_password``. Every other option is redis-py's
  (``socket_timeout``, ``ssl_cert_reqs``, ``ssl_ca_certs``, ...) and applies to both. After a
  failover the connections find the promoted replica by themselves: a command that met the dead
  or demoted primary fails with ``redis.ConnectionError``, and its retry reaches the new one.
- ``redis+cluster://[[user]:password@]host[:port][,host[:port]...][?option=value...]`` and
  ``rediss+cluster://...`` (TLS): some nodes of a Redis Cluster (port 6379 when left out), from
  which redis-py's ``RedisCluster`` learns the rest and follows the slots as they move. A
  cluster has one database: a path, if any, is ``/0``. Options as for ``redis://``. The protocol
  runs on a cluster only in its cluster layout (``--queue-shards N``; PROTOCOL.md).

This module imports no torch (``producers/`` never does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.asyncio.cluster as aiocluster
import redis.cluster
import redis.sentinel

from producers.cluster_keys import AsyncLocalKeys, LocalKeys

DEFAULT_URL = "redis://localhost:6379/0"
URL_ENV = "SLUICEWAY_REDIS_URL"
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
DEFAULT_SENTINEL_PORT = 26379
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
DEFAULT_CLUSTER_PORT = 6379
# Options that belong to the sentinels alone (redis-py's Sentinel takes them as ``sentinel_kwargs``).
SENTINEL_OPTIONS = {"sentinel_username": "username", "sentinel_password": "password"}


def resolve_url(url: str | None) -> str:
    """``url``, else ``$SLUICEWAY_REDIS_URL``, else ``redis://localhost:6379/0``."""
    return url or os.environ.get(URL_ENV) or DEFAULT_URL


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int
    tls: bool
    node_options: dict[str, Any] = field(default_factory=dict)  # for the primary's connections
    sentinel_options: dict[str, Any] = field(default_factory=dict)  # for the sentinels' own


def redacted(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and errors)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{hosts}{slash}{path}"


def is_sentinel_url(url: str) -> bool:
    return url.partition("://")[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The parts of a ``redis+sentinel://`` URL; ``ValueError`` naming what is wrong."""
    tls, userinfo, hosts, path, query = _split_hosts_url(url, SENTINEL_SCHEMES)
    sentinels = tuple(_host_port(part, url) for part in hosts.split(","))
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ValueError(f"redis url: {redacted(url)[:200]!r} must name the service after the hosts: "
                         "redis+sentinel://host:port,host:port/service_name[/db]")
    service_name = unquote(parts[0])
    try:
        db = int(parts[1]) if len(parts) == 2 else 0
    except ValueError:
        raise ValueError(f"redis url: db {parts[1][:20]!r} is not a number") from None
    pairs = parse_qsl(query, keep_blank_values=True)
    sentinel_only = {SENTINEL_OPTIONS[k]: v for k, v in pairs if k in SENTINEL_OPTIONS}
    shared = [(k, v) for k, v in pairs if k not in SENTINEL_OPTIONS]
    node = _node_options(tls, userinfo, db, urlencode(shared))
    db = node.pop("db", db)
    sentinel = {k: v for k, v in node.items() if k.startswith(("socket_", "ssl_"))}
    sentinel.update(sentinel_only)
    if tls:
        node["ssl"] = sentinel["ssl"] = True
    return SentinelTarget(sentinels, service_name, db, tls, node, sentinel)


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


@dataclass(frozen=True)
class ClusterTarget:
    """A parsed ``redis+cluster://`` URL."""

    nodes: tuple[tuple[str, int], ...]
    options: dict[str, Any] = field(default_factory=dict)  # for every node's connections


def parse_cluster_url(url: str) -> ClusterTarget:
    """The parts of a ``redis+cluster://`` URL; ``ValueError`` naming what is wrong."""
    tls, userinfo, hosts, path, query = _split_hosts_url(url, CLUSTER_SCHEMES)
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"redis url: db {path.strip('/')[:20]!r} of {redacted(url)[:200]!r}: a Redis Cluster "
                         "has database 0 alone")
    nodes = tuple(_host_port(part, url, DEFAULT_CLUSTER_PORT, "cluster node") for part in hosts.split(","))
    options = _node_options(tls, userinfo, 0, query)
    options.pop("db", None)
    if tls:
        options["ssl"] = True
    return ClusterTarget(nodes, options)


def _split_hosts_url(url: str, schemes: dict[str, bool]) -> tuple[bool, str, str, str, str]:
    """(TLS, user info, comma-separated hosts, path, query) of a URL of one of ``schemes``
    (scheme -> TLS); ``ValueError`` for another scheme."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        raise ValueError(f"redis url: {redacted(url)[:200]!r} is not a {' or '.join(schemes)} URL")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    return schemes[scheme.lower()], userinfo, hosts, path, query


def _node_options(tls: bool, userinfo: str, db: int, query: str) -> dict[str, Any]:
    """redis-py's connection options for the nodes of a many-host URL (credentials, ``db`` and
    the query's options).

    NOTE: redis-py parses them (their types, its error messages) from a plain URL that carries
    them; host and port there are placeholders, dropped here."""
    plain = f"{'rediss' if tls else 'redis'}://{userinfo + '@' if userinfo else ''}localhost/{db}" \
            + (f"?{query}" if query else "")
    try:
        options = redis.connection.parse_url(plain)
    except ValueError as exc:
        raise ValueError(f"redis url: {exc}") from None
    for name in ("host", "port", "connection_class"):
        options.pop(name, None)
    return options


def _host_port(part: str, url: str, default_port: int = DEFAULT_SENTINEL_PORT,
               what: str = "sentinel") -> tuple[str, int]:
    if part.startswith("["):  # [ipv6]:port
        host, _, tail = part[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
    if not host:
        raise ValueError(f"redis url: {redacted(url)[:200]!r} has an empty {what} host")
    try:
        number = int(port) if port else default_port
    except ValueError:
        number = -1
    if not 0 < number < 65536:
        raise ValueError(f"redis url: {what} port {port[:20]!r} of {host[:100]!r} must be 1-65535")
    return host, number


def connect(url: str | None = None, **options: Any) -> redis.Redis:
    """A redis-py client for ``url`` (any form above; ``None``: ``resolve_url``). ``options``
    are redis-py's (``decode_responses``, ``socket_timeout``, ...) and win over the URL's."""
    url = resolve_url(url)
    if is_cluster_url(url):
        cluster = parse_cluster_url(url)
        client = redis.cluster.RedisCluster(startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in cluster.nodes],
                                            **{**cluster.options, **options})
        client.commands_parser = LocalKeys(client.commands_parser)
        return client
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    target = parse_sentinel_url(url)
    manager = redis.sentinel.Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, options))
    return manager.master_for(target.service_name, db=target.db, **{**target.node_options, **options})


def connect_async(url: str | None = None, **options: Any) -> aioredis.Redis:
    """``connect`` for ``redis.asyncio``: the same URLs, the same options."""
    url = resolve_url(url)
    if is_cluster_url(url):
        cluster = parse_cluster_url(url)
        client = aiocluster.RedisCluster(startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in cluster.nodes],
                                         **{**cluster.options, **options})
        client.commands_parser = AsyncLocalKeys(client.commands_parser)
        return client
    if not is_sentinel_url(url):
        return aioredis.Redis.from_url(url, **options)
    target = parse_sentinel_url(url)
    manager = aiosentinel.Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, options))
    return manager.master_for(target.service_name, db=target.db, **{**target.node_options, **options})


class UnsupportedServer(ValueError):
    """The URL reaches a server the protocol cannot run on as asked (a Redis Cluster without the
    cluster layout, a cluster node reached by a plain URL)."""


def is_cluster_client(client: Any) -> bool:
    """Whether ``client`` is redis-py's cluster client (sync or asyncio)."""
    return isinstance(client, (redis.cluster.RedisCluster, aiocluster.RedisCluster))


NEEDS_LAYOUT = ("redis: a Redis Cluster needs the cluster layout: give queue_shards=N (--queue-shards N, the "
                "workers' --queue-shards; PROTOCOL.md, 'The cluster layout')")


def check_cluster_layout(client_or_url: Any, queue_shards: int) -> None:
    """``UnsupportedServer`` for a cluster client (or a ``redis+cluster://`` URL) without the cluster
    layout: said when the client is made, not as CROSSSLOT at its first command."""
    cluster = is_cluster_url(client_or_url) if isinstance(client_or_url, str) else is_cluster_client(client_or_url)
    if cluster and not queue_shards:
        raise UnsupportedServer(NEEDS_LAYOUT)


def check_server(client: Any, queue_shards: int = 0) -> None:
    """Raise ``UnsupportedServer`` when the protocol cannot run on ``client``'s server as asked.

    NOTE: said once, at startup, rather than as MOVED or CROSSSLOT one job at a time: a cluster
    needs the cluster client (``redis+cluster://``) and the cluster layout (``queue_shards`` >= 1:
    the single-node layout's keys share no hash tags). ``HELLO`` (no arguments: the protocol
    stays as it is) names a node's mode; a server that refuses it (Redis 6.0, an ACL without it)
    is taken for a single one."""
    if is_cluster_client(client):
        if not queue_shards:
            raise UnsupportedServer("redis: the server is a Redis Cluster; the protocol runs there in its cluster "
                                    "layout alone: give --queue-shards N (N >= 1, the same on every worker and "
                                    "producer; PROTOCOL.md, 'The cluster layout')")
        return
    try:
        reply = client.execute_command("HELLO")
    except redis.ResponseError:
        return
    fields = dict(zip(reply[::2], reply[1::2])) if isinstance(reply, list) else dict(reply or {})
    mode = {_text(k): _text(v) for k, v in fields.items()}.get("mode")
    if mode == "cluster":
        raise UnsupportedServer("redis: the server is a Redis Cluster node reached by a single-node URL; give "
                                "redis+cluster://host:port[,host:port...] and --queue-shards N")


def check_layout(client: Any, prefix: str, layout_key: str, queue_shards: int) -> None:
    """Record the cluster layout's shard count under ``layout_key`` (the first worker of a prefix
    does), and raise ``UnsupportedServer`` when the workers there run another count.

    NOTE: workers and producers of one prefix must agree on N: a job submitted with another N
    lands on a stream nobody reads. The first worker's N stands until the key is deleted (drain
    the queues first). The single-node layout (N = 0) reads and writes no such key."""
    if not queue_shards:
        return
    mine = f"shards={queue_shards}"
    client.set(layout_key, mine, nx=True)
    found = _text(client.get(layout_key) or b"")
    if found != mine:
        raise UnsupportedServer(f"queue_shards: this worker has {queue_shards}, but the workers of prefix "
                                f"{prefix[:100]!r} run {found[:40]!r} ({layout_key}); give every worker and "
                                "producer the same --queue-shards")


def connection_kwargs_of(client: Any) -> dict[str, Any]:
    """The options ``client``'s connections are made with (a cluster client's too)."""
    if is_cluster_client(client):
        return dict(client.get_connection_kwargs())
    return client.connection_pool.connection_kwargs


def check_standalone(client: redis.Redis) -> None:
    """``check_server`` of the single-node layout (kept for callers of the earlier name)."""
    check_server(client, 0)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _sentinel_kwargs(target: SentinelTarget, options: dict[str, Any]) -> dict[str, Any]:
    """How to talk to the sentinels: the URL's socket and TLS options, the caller's socket timeouts."""
    socket = {k: v for k, v in options.items() if k.startswith("socket_")}
    return {**target.sentinel_options, **socket}


# --- the same URLs, spelled for Celery -------------------------------------------------------------

@dataclass(frozen=True)
class CeleryTarget:
    """One Redis URL as Celery takes it, for its broker and its result backend alike."""

    url: str
    transport_options: dict[str, Any] = field(default_factory=dict)  # broker_ and result_backend_transport_options

    def config(self) -> dict[str, Any]:
        """Settings for ``app.conf.update(...)`` of a Celery app on this Redis (broker and backend)."""
        return {"broker_url": self.url, "result_backend": self.url,
                "broker_transport_options": dict(self.transport_options),
                "result_backend_transport_options": dict(self.transport_options)}


def celery_target(redis_url: str) -> CeleryTarget:
    """The Celery spelling of a URL of the forms above.

    ``unix:///path?db=N`` becomes ``redis+socket:///path?virtual_host=N``; a ``rediss://`` URL
    without ``ssl_cert_reqs`` gets ``ssl_cert_reqs=required`` -- redis-py's default, which
    Celery will not assume (its backend refuses such a URL; kombu would skip the check); a
    ``redis+sentinel://`` URL becomes kombu's ``sentinel://h1:p1/db;sentinel://h2:p2/db`` with
    the service as the ``master_name`` transport option.
    """
    if is_cluster_url(redis_url):
        raise ValueError(f"celery: {redacted(redis_url)[:200]!r}: Celery's Redis transport has no cluster mode; "
                         "give Celery a broker of its own (--celery-broker), or --no-celery")
    if is_sentinel_url(redis_url):
        target = parse_sentinel_url(redis_url)
        if target.tls:
            raise ValueError(f"celery: {redacted(redis_url)[:200]!r}: Celery's sentinel transport is set up here "
                             "without TLS; give Celery its own broker URL and transport options")
        userinfo = redis_url.partition("://")[2].partition("/")[0].rpartition("@")[0]
        auth = f"{userinfo}@" if userinfo else ""
        url = ";".join(f"sentinel://{auth}{_bracketed(host)}:{port}/{target.db}" for host, port in target.sentinels)
        options: dict[str, Any] = {"master_name": target.service_name}
        if target.sentinel_options:
            options["sentinel_kwargs"] = dict(target.sentinel_options)
        return CeleryTarget(url, options)
    parts = urlsplit(redis_url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.scheme == "unix":
        query = [("virtual_host" if k == "db" else k, v) for k, v in query]
        return CeleryTarget(_url("redis+socket", parts.netloc, parts.path, query))
    if parts.scheme == "rediss" and not any(k == "ssl_cert_reqs" for k, _ in query):
        return CeleryTarget(_url("rediss", parts.netloc, parts.path, [*query, ("ssl_cert_reqs", "required")]))
    return CeleryTarget(redis_url)


def celery_url(redis_url: str) -> str:
    """``celery_target(redis_url).url``."""
    return celery_target(redis_url).url


def broker_redis_url(broker_url: str) -> str:
    """The URL ``connect`` opens for a Celery Redis broker URL (``celery_url`` undone), to read queue depths."""
    parts = urlsplit(broker_url)
    if parts.scheme in ("redis+socket", "socket"):
        query = parse_qsl(parts.query, keep_blank_values=True)
        return _url("unix", parts.netloc, parts.path, [("db" if k == "virtual_host" else k, v) for k, v in query])
    return broker_url


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _url(scheme: str, netloc: str, path: str, query: list[tuple[str, str]]) -> str:
    # NOTE: not urlunsplit, which drops the empty host of "unix:///path"
    return f"{scheme}://{netloc}{path}" + (f"?{urlencode(query)}" if query else "")
