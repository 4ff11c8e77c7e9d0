"""The real-server fixtures the other suites build on."""

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.redis_server import EmbeddedRedis


def test_fresh_server_per_test(redis_client):
    assert redis_client.ping()
    assert redis_client.dbsize() == 0
    assert redis_client.execute_command("XINFO", "HELP")  # streams are there


def test_aof_survives_a_crash_on_the_same_url(redis_server_factory):
    server = redis_server_factory(appendonly=True, appendfsync="always")
    client = redis.Redis.from_url(server.url)
    client.xadd("s", {"job": "1"})
    client.set("k", "v")
    url = server.url
    server.restart(crash=True)
    assert server.url == url
    assert client.get("k") == b"v"  # the pool reconnects to the same address
    assert client.xlen("s") == 1
    client.close()


def test_without_persistence_a_restart_forgets(redis_server_factory):
    server = redis_server_factory()
    client = server.client()
    client.set("k", "v")
    server.restart()
    assert client.get("k") is None
    client.close()


def test_unix_socket_and_password(redis_server_factory):
    server = redis_server_factory(unix_socket=True, password="p@ss word")
    assert server.url.startswith("unix://")
    assert redis.Redis.from_url(server.url).ping()
    try:
        redis.Redis(unix_socket_path=str(server.socket_path), retry=Retry(NoBackoff(), 0)).ping()
    except redis.AuthenticationError:
        pass
    else:
        raise AssertionError("a server with a password accepted a client without one")


def test_context_manager_cleans_up(tmp_path):
    with EmbeddedRedis(tmp_path / "d") as server:
        assert server.client().ping()
        pid = server.pid
    assert not server.running and pid is not None
