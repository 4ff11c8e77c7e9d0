"""``producers.connection``: every URL form, parsed and opened against real servers (plain Redis,
and a primary with a replica behind three real sentinels)."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
from click.testing import CliRunner

from producers.aio import AsyncClient
from producers.cli import cli
from producers.client import Client
from producers.connection import celery_target, connect, connect_async, parse_sentinel_url, redacted
from tests.producers.peer import HandWorker
from tests.redis_server import redis7_executable
from tests.redis_topologies import SERVICE, SentinelSet


def test_a_sentinel_url_names_its_sentinels_service_db_and_options():
    target = parse_sentinel_url("redis+sentinel://app:s3cret@10.0.0.1:26380,node-b,[::1]:5000/orders/3"
                                "?socket_timeout=2.5&sentinel_password=sp")
    assert target.sentinels == (("10.0.0.1", 26380), ("node-b", 26379), ("::1", 5000))
    assert (target.service_name, target.db, target.tls) == ("orders", 3, False)
    assert target.node_options == {"username": "app", "password": "s3cret", "socket_timeout": 2.5}
    assert target.sentinel_options == {"password": "sp", "socket_timeout": 2.5}
    tls = parse_sentinel_url("rediss+sentinel://h1/svc?ssl_cert_reqs=none")
    assert tls.tls and tls.db == 0 and tls.node_options == {"ssl": True, "ssl_cert_reqs": "none"}
    assert tls.sentinel_options == {"ssl": True, "ssl_cert_reqs": "none"}


@pytest.mark.parametrize("url, message", [
    ("redis+sentinel://h1:26379", "must name the service"),
    ("redis+sentinel://h1/svc/0/extra", "must name the service"),
    ("redis+sentinel://h1/svc/zero", "db 'zero' is not a number"),
    ("redis+sentinel://h1:99999/svc", "sentinel port '99999' of 'h1' must be 1-65535"),
    ("redis+sentinel://h1,:26379/svc", "empty sentinel host"),
    ("redis+sentinel://h1/svc?socket_timeout=soon", "Invalid value for 'socket_timeout'"),
])
def test_a_bad_sentinel_url_is_a_clear_error(url, message):
    with pytest.raises(ValueError, match=message):
        connect(url)


def test_errors_and_logs_never_show_the_password():
    assert redacted("redis+sentinel://app:s3cret@h1,h2/svc") == "redis+sentinel://app:***@h1,h2/svc"
    assert redacted("redis://:pw@host:6379/0") == "redis://:***@host:6379/0"
    with pytest.raises(ValueError) as info:
        connect("redis+sentinel://app:s3cret@h1")
    assert "s3cret" not in str(info.value)


def test_plain_urls_open_as_redis_py_opens_them(redis_server):
    with connect(redis_server, decode_responses=True) as r:
        assert r.ping() and r.set("k", "v") and r.get("k") == "v"


@pytest.fixture(scope="module")
def sentinels(tmp_path_factory):
    group = SentinelSet(redis7_executable(), tmp_path_factory.mktemp("sentinels"))
    yield group.start()
    group.close()


def test_sync_and_asyncio_clients_reach_the_primary_through_sentinels(sentinels):
    with connect(sentinels.url) as r:
        assert r.info("server")["tcp_port"] == sentinels.primary.port
    with Client(sentinels.url) as client:
        job_id = client.submit("hello", sampling={"max_tokens": 4})
        assert client.status(job_id).status.value == "queued"

    async def submit_and_wait() -> str:
        async with AsyncClient(sentinels.url, queue="bulk") as aclient:
            job = await aclient.submit("hi", sampling={"max_tokens": 4})
            return (await aclient.result(job, timeout=20)).text

    with HandWorker(sentinels.primary.url):
        assert asyncio.run(submit_and_wait()) == "HI"

    async def ping() -> bool:
        conn = connect_async(sentinels.url)
        try:
            return await conn.ping()
        finally:
            await conn.aclose()

    assert asyncio.run(ping())


def test_bulk_runs_on_a_sentinel_url(sentinels, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    with HandWorker(sentinels.primary.url):
        res = CliRunner().invoke(cli, ["bulk", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                                       "--no-progress", "--redis", sentinels.url])
    assert res.exit_code == 0, res.output
    assert [json.loads(line)["text"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == ["A", "B"]


def test_an_unknown_service_is_a_connection_error(sentinels):
    url = sentinels.url.replace(f"/{SERVICE}/", "/no-such-service/")
    with pytest.raises(redis.ConnectionError, match="no-such-service"):
        connect(url, socket_timeout=2).ping()


def test_celery_spells_a_sentinel_url_as_kombu_does():
    target = celery_target("redis+sentinel://:pw@h1:26380,[::1]/orders/2?sentinel_password=sp")
    assert target.url == "sentinel://:pw@h1:26380/2;sentinel://:pw@[::1]:26379/2"
    assert target.config()["result_backend_transport_options"] == {"master_name": "orders",
                                                                    "sentinel_kwargs": {"password": "sp"}}
    with pytest.raises(ValueError, match="without TLS"):
        celery_target("rediss+sentinel://h1/orders")


def test_the_keys_of_stream_reads_and_scripts_are_read_as_the_server_reads_them(redis_server):
    from producers.cluster_keys import stream_or_script_keys

    commands = [
        ("XREADGROUP", b"GROUP", "workers", "w1", b"COUNT", 5, b"BLOCK", 100, b"STREAMS", "a", "b", ">", ">"),
        ("XREADGROUP", "GROUP", "workers", "streams", "NOACK", "STREAMS", "{s1}:q", "0"),  # a consumer named streams
        ("XREAD", "COUNT", 256, "BLOCK", 0, "STREAMS", "t:1", "$"),
        ("EVALSHA", "0" * 40, 2, "k1", "k2", "arg", "more"),
        ("EVAL", "return 1", 1, "only"),
    ]
    with redis.Redis.from_url(redis_server, decode_responses=True) as r:
        for args in commands:
            text = [a.decode() if isinstance(a, bytes) else a for a in args]
            assert stream_or_script_keys(args) == r.command_getkeys(*text), args
    for odd in [("GET", "k"), ("XREADGROUP", "GROUP", "g"), ("XREAD", "STREAMS", "a"), ("EVALSHA", "x", 0),
                ("XREAD", "WEIRD", 1, "STREAMS", "a", "0"), ("EVALSHA", "x", 3, "k1")]:
        assert stream_or_script_keys(odd) is None, odd  # the server is asked, as before
