"""Real ``redis-server`` fixtures for every test suite (never a mock).

``redis_server`` yields the URL of a fresh private server per test. ``redis_server_factory``
hands out ``EmbeddedRedis`` handles for tests that need persistence, a password, a unix
socket, or to stop/kill/restart the server mid-run::

    def test_survives_restart(redis_server_factory):
        server = redis_server_factory(appendonly=True, appendfsync="always")
        ...
        server.restart(crash=True)  # same data dir, same URL
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from worker.embedded_redis import EmbeddedRedis, find_redis_server, free_port

__all__ = [
    "EmbeddedRedis",
    "find_redis_server",
    "free_port",
    "redis_server",
    "redis_server_factory",
    "redis_client",
]


@pytest.fixture
def redis_server_factory(tmp_path_factory) -> Iterator[Callable[..., EmbeddedRedis]]:
    """Start servers with ``EmbeddedRedis`` options; all are killed at teardown."""
    servers: list[EmbeddedRedis] = []

    def make(*, start: bool = True, data_dir=None, **options) -> EmbeddedRedis:
        server = EmbeddedRedis(data_dir or tmp_path_factory.mktemp("redis"), **options)
        servers.append(server)
        return server.start() if start else server

    yield make
    for server in servers:
        server.kill()
        server.cleanup()


@pytest.fixture
def redis_server(redis_server_factory) -> str:
    """URL of a fresh private redis-server (TCP on 127.0.0.1, no persistence)."""
    return redis_server_factory().url


@pytest.fixture
def redis_client(redis_server) -> Iterator[redis.Redis]:
    """A bytes-returning redis-py client for ``redis_server``."""
    client = redis.Redis.from_url(redis_server)
    yield client
    client.close()
