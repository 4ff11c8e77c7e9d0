"""The gateway while its Redis is away: a request is a 503 ``redis_unavailable`` on a connection
that stays open, and the same connection is served again once Redis is back."""

from __future__ import annotations

import http.client
import json

from producers.embedded_redis import EmbeddedRedis
from tests.gateway.conftest import ALICE, KEYS, TENANTS, GatewayProcess, hand_record, wait_for


def test_a_request_while_redis_is_away_is_503_and_the_connection_serves_on(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    client = server.client()
    client.hset(KEYS.workers, "m-1", hand_record("m-1", "m", ["m"], alive=True))  # a model the gateway lists
    client.close()
    gateway = GatewayProcess(tmp_path, server.url, *TENANTS)
    try:
        server.kill()
        conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
        body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1})
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {ALICE}"}
        for _ in range(3):  # was: the server dropped the connection after each, so every other request was reset
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            reply = conn.getresponse()
            error = json.loads(reply.read())["error"]
            assert reply.status == 503 and error["code"] == "redis_unavailable", error
            assert reply.getheader("retry-after") == "1"
        # a pass of the batch feeder's scan meets the outage too (was a traceback each pass, 4 a second)
        wait_for(lambda: "batch scan" in gateway.output(), timeout=10, what="a batch scan while Redis is away")
        restarted = EmbeddedRedis(tmp_path / "redis", port=server.port).start()
        try:
            conn.request("GET", "/health")  # the same connection, the gateway's client reconnected
            assert conn.getresponse().status == 200
        finally:
            conn.close()
            assert gateway.stop() == 0
            restarted.kill()
    finally:
        if gateway.proc.poll() is None:
            gateway.proc.kill()
        server.kill()
    log = gateway.output()
    assert "redis unavailable" in log and "Traceback" not in log  # one line a request, no traceback each
