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

import os
from collections.abc import Callable, Iterator
from pathlib import Path

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
    "redis7_executable",
    "server_major",
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


REDIS7_ENV = "SLUICEWAY_TEST_REDIS7"
# Where scripts/test.sh unpacks Debian's Redis 7 (a wrapper that sets its library path).
REDIS7_DEFAULT = Path(__file__).resolve().parent.parent / ".cache" / "redis7" / "redis-server"


def redis7_executable() -> str:
    """Redis 7's ``redis-server`` for tests: ``$SLUICEWAY_TEST_REDIS7`` or ``.cache/redis7``.

    Skips the calling test when there is none, except under CI (``CI=true``), where a
    missing Redis 7 is a failure: scripts/test.sh always provides one there.
    """
    explicit = os.environ.get(REDIS7_ENV)
    candidate = Path(explicit) if explicit else REDIS7_DEFAULT
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    why = f"no Redis 7 redis-server at {candidate} (scripts/test.sh unpacks one; or set {REDIS7_ENV})"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(why)
    pytest.skip(why)


def server_major(client: redis.Redis) -> int:
    """The major version of the Redis server ``client`` talks to."""
    return int(str(client.info("server")["redis_version"]).split(".")[0])
