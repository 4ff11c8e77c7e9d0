"""A worker process on a Sentinel URL survives kill -9 of the Redis primary: the sentinels promote
the replica, the worker, the clients and the gateway find it, every job ends exactly once, and
streams (the protocol's and the gateway's) go on with every token once."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from producers.celery_app import generate_signature
from producers.client import Client
from producers.connection import celery_target, connect
from producers.protocol import Keys
from tests.redis_server import redis7_executable
from tests.redis_topologies import SentinelSet
from tests.worker.conftest import CLIENT_KWARGS, pending_count, wait_for
from tests.gateway.conftest import BOB, TENANTS, GatewayProcess
from tests.gateway.test_errors import job_id_of
from tests.worker.test_process import WorkerProcess

KEYS = Keys()
LONG = {"temperature": 0, "max_tokens": 200, "ignore_eos": True}
HTTP_TOKENS = 480  # the gateway's stream starts first and outlasts the jobs


@pytest.fixture
def sentinels(tmp_path):
    group = SentinelSet(redis7_executable(), tmp_path / "ha").start()
    yield group
    group.close()


def test_kill_9_of_the_primary_mid_run_loses_no_job_and_ends_none_twice(sentinels, tiny_model, tmp_path):
    celery = pytest.importorskip("celery")
    app = celery.Celery("app")
    app.conf.update(celery_target(sentinels.url).config())  # the Celery ingress rides the same sentinels
    gateway = GatewayProcess(tmp_path, sentinels.url, *TENANTS)
    worker = WorkerProcess(tiny_model, tmp_path, "--name", "ha", "--served-model-name", "ha-model",
                           redis_url=sentinels.url)
    client = Client(sentinels.url, **CLIENT_KWARGS)
    try:
        with ThreadPoolExecutor(6) as pool:
            http = gateway.client(BOB)
            wait_for(lambda: [m.id for m in http.models.list().data] == ["ha-model"], timeout=120,
                     what="the worker's model on the gateway")
            over_http = http.completions.create(  # the gateway's stream, read by its shared reader
                model="ha-model", prompt="over http", max_tokens=HTTP_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            chunks = iter(over_http)
            first = next(chunks)
            http_job = job_id_of(first.id)
            http_rest = pool.submit(lambda: list(chunks))
            ids = client.submit_many([{"prompt": f"job {i}", "sampling": LONG, "stream": i % 2 == 0}
                                      for i in range(12)])
            tasks = [generate_signature(prompt=f"task {i}", sampling=LONG, app=app).apply_async() for i in range(2)]
            streamed = {j: pool.submit(lambda j=j: [t for d in client.stream_deltas(j, timeout=120)
                                                    for t in d.token_ids]) for j in ids[::2]}
            wait_for(lambda: [client.status(j).status.value for j in ids].count("done") >= 1, timeout=60,
                     what="a job done before the failover")
            running = [j for j in ids if client.status(j).status.value == "running"]
            assert running and client.status(http_job).status.value == "running", "the kill should land mid-run"
            killed_at = time.time()
            sentinels.kill_primary()
            promoted_s = sentinels.wait_promoted()
            results = {j: client.result(j, timeout=120) for j in ids}
            tokens = {j: future.result(timeout=120) for j, future in streamed.items()}
            assert [t.get(timeout=120)["usage"]["completion_tokens"] for t in tasks] == [200, 200]
            rest = http_rest.result(timeout=120)
            assert rest[-1].usage.completion_tokens == HTTP_TOKENS
            http_text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
            assert http_text == client.result(http_job, timeout=60).outputs[0].text  # every token once
        assert gateway.stop() == 0 and worker.stop(signal.SIGTERM) == 0
    finally:
        client.close()
        app.close()
        for proc in (gateway, worker):
            if proc.proc.poll() is None:
                proc.stop(signal.SIGKILL)
    for job_id in ids:
        assert results[job_id].usage.completion_tokens == 200
    for job_id, ids_streamed in tokens.items():  # every token once, in order, across the failover
        assert ids_streamed == results[job_id].outputs[0].token_ids
    with connect(sentinels.url, decode_responses=True) as r:
        assert r.info("server")["tcp_port"] == sentinels.replica.port  # the promoted replica
        for job_id in [*ids, http_job]:
            assert r.llen(KEYS.done(job_id)) == 1, f"{job_id} ended {r.llen(KEYS.done(job_id))} times"
            assert r.hget(KEYS.job(job_id), "status") == "done"
        assert pending_count(r, "interactive") == 0 and r.xlen(KEYS.queue("interactive")) == 0
        finished = sorted(float(r.hget(KEYS.job(j), "finished_at")) for j in ids)
    stall = next(t for t in finished if t > killed_at) - killed_at
    print(f"\nfailover: promoted after {promoted_s:.2f}s; first job ended {stall:.2f}s after the kill")
    assert stall < 60
