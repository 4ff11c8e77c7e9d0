"""``sluiceway serve`` as a process: without --redis it runs a private redis-server and stops it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import redis

from gateway.shutdown import STOP_WAIT_S
from producers.embedded_redis import free_port
from tests.gateway.conftest import wait_for


def test_without_redis_it_serves_over_a_private_server_and_stops_it():
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
    environ["SLUICEWAY_PORT"] = str(port)  # flags from the environment, as documented
    proc = subprocess.Popen([sys.executable, "-m", "sluiceway", "serve"], env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        line = proc.stdout.readline().decode()
        url = re.search(r"redis://\S+", line).group(0)
        assert redis.Redis.from_url(url, socket_connect_timeout=2).ping()

        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout=60, what="the gateway's /health")
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json() == {"object": "list", "data": []}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


@pytest.mark.parametrize("url, message", [
    ("bogus://host/0", "error: redis: Redis URL must specify one of the following schemes"),
    ("redis://host:notaport/0", "error: redis: Port could not be cast to integer value as 'notaport'"),
])
def test_a_redis_url_it_cannot_open_is_one_line_and_exit_2(url, message):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
    run = subprocess.run([sys.executable, "-m", "sluiceway", "serve", "--redis", url, "--port", str(free_port())],
                         env=environ, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("where, message", [
    (["--host", "no-such-host.invalid"], "error: host: 'no-such-host.invalid' cannot be resolved ("),
    (["--host", "192.0.2.1"], "error: host: cannot bind to '192.0.2.1' ("),  # TEST-NET-1: on no interface here
    (["--port", "{taken}"], "error: port: cannot bind to {taken} on 127.0.0.1 (Address already in use)"),
])
def test_a_host_or_port_it_cannot_listen_on_is_one_line_and_exit_2_before_anything_starts(where, message):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
    with socket.create_server(("127.0.0.1", 0)) as taken:  # a port something listens on
        port = str(taken.getsockname()[1])
        args = [a.format(taken=port) for a in where]
        started = time.monotonic()
        # no --redis: a private redis-server would be started first, and its line printed, were it not refused before
        proc = subprocess.Popen([sys.executable, "-m", "sluiceway", "serve", *args], env=environ,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        elapsed = time.monotonic() - started
    assert proc.returncode == 2, err
    assert err.splitlines() == [err.strip()] and err.startswith(message.format(taken=port)), err
    assert out == ""
    assert elapsed < STOP_WAIT_S  # not after a shutdown that waited on a batch task
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing it started outlives it


@pytest.mark.parametrize("args, env, message", [
    # inf: every request a 400 (its job's deadline); 1e300: a 500 under --max-outstanding (the EXPIRE)
    (["--request-timeout", "inf"], {}, "--request-timeout (env SLUICEWAY_REQUEST_TIMEOUT): Input should be a finite"),
    (["--request-timeout", "1e300"], {}, "--request-timeout (env SLUICEWAY_REQUEST_TIMEOUT): Input should be less than"
                                         " or equal to 2147483647"),
    (["--models-refresh-seconds", "inf"], {}, "--models-refresh-seconds (env SLUICEWAY_MODELS_REFRESH_SECONDS): Input"
                                              " should be a finite number"),
    # the last tenant silently took the key
    (["--api-key", "alice=k1", "--api-key", "bob=k1"], {}, "--api-key (env SLUICEWAY_API_KEY): api_key: one key is"
                                                           " given to two tenants, alice and bob"),
    # a limit for a tenant no key names was no limit
    ([], {"SLUICEWAY_API_KEY": "alice=k1,bob=k2", "SLUICEWAY_TENANT_MAX_OUTSTANDING": "alcie=3"},
     "--tenant-max-outstanding (env SLUICEWAY_TENANT_MAX_OUTSTANDING): tenant_max_outstanding: 'alcie' names no"
     " tenant (the tenants of --api-key: alice, bob)"),
    (["--tenant-max-outstanding", "alice=3"], {}, "'alice' names no tenant (without --api-key the one tenant is default)"),
    # the flag is repeated as its help says (only the last one counted)
    (["--api-key", "alice=k1", "--tenant-max-outstanding", "alice=3", "--tenant-max-outstanding", "alice=2"], {},
     "tenant_max_outstanding: tenant alice is given two limits"),
    # auto tool choice reads calls in a format it must be told, as vLLM's flag needs its parser
    (["--enable-auto-tool-choice"], {}, "--enable-auto-tool-choice (env SLUICEWAY_ENABLE_AUTO_TOOL_CHOICE):"
                                        " enable_auto_tool_choice needs --tool-call-parser (hermes, llama3_json)"),
    # a parser per model: repeated flags, or comma-separated in the environment, each checked
    (["--tool-call-parser", "hermes", "--tool-call-parser", "llama3-8b=mistral"], {},
     "--tool-call-parser (env SLUICEWAY_TOOL_CALL_PARSER): tool_call_parser: 'llama3-8b=mistral': 'mistral' is not a"
     " tool-call parser (they are: hermes, llama3_json)"),
    ([], {"SLUICEWAY_TOOL_CALL_PARSER": "hermes,=llama3_json"},
     "--tool-call-parser (env SLUICEWAY_TOOL_CALL_PARSER): tool_call_parser: '=llama3_json' must be PARSER (every"
     " model's) or MODEL=PARSER (one model's); the parsers are hermes, llama3_json"),
])
def test_settings_it_cannot_honour_are_a_usage_error_before_anything_starts(args, env, message):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
    # no --redis: a private redis-server would be started (and said on stdout) were it not refused first
    run = subprocess.run([sys.executable, "-m", "sluiceway", "serve", "--port", str(free_port()), *args],
                         env={**environ, **env}, capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
