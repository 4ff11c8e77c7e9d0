"""The gateway on a Sentinel URL: a stream goes on through kill -9 of the Redis primary (the
sentinels promote the replica; the worker, the gateway and its shared stream reader find it),
with every token once, and the gateway answers after the failover."""

from __future__ import annotations

import signal
import time

import pytest

from producers.connection import connect
from producers.protocol import Keys
from tests.gateway.conftest import BOB, MODEL, TENANTS, GatewayProcess, wait_for
from tests.gateway.test_errors import job_id_of
from tests.gateway.test_openai import PROMPT, greedy
from tests.redis_server import redis7_executable
from tests.redis_topologies import SentinelSet
from tests.worker.test_process import WorkerProcess

KEYS = Keys()
LONG = 300  # tokens: enough that the kill lands while the job streams


@pytest.fixture
def sentinels(tmp_path):
    group = SentinelSet(redis7_executable(), tmp_path / "ha").start()
    yield group
    group.close()


def test_a_stream_through_the_gateway_goes_on_through_kill_9_of_the_primary(sentinels, tiny_model, tmp_path,
                                                                           offline):
    worker = WorkerProcess(tiny_model, tmp_path, "--name", "gw-ha", "--served-model-name", MODEL, "--no-celery",
                           redis_url=sentinels.url)
    gateway = GatewayProcess(tmp_path, sentinels.url, *TENANTS)
    try:
        client = gateway.client(BOB)
        wait_for(lambda: MODEL in [m.id for m in client.models.list().data], timeout=120, what="the worker's model")
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(chunks)
        job_id = job_id_of(first.id)
        with connect(sentinels.url, decode_responses=True) as r:
            assert r.hget(KEYS.job(job_id), "status") == "running", "the kill should land while the job streams"
        killed_at = time.monotonic()
        sentinels.kill_primary()
        sentinels.wait_promoted()
        rest = list(chunks)
        stalled_s = time.monotonic() - killed_at
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
        assert text == offline.generate([PROMPT], greedy(LONG), use_tqdm=False)[0].outputs[0].text
        assert rest[-1].usage.completion_tokens == LONG
        after = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert after.usage.completion_tokens == 4  # served on the promoted replica
        with connect(sentinels.url, decode_responses=True) as r:
            assert r.info("server")["tcp_port"] == sentinels.replica.port
            assert r.llen(KEYS.done(job_id)) == 1 and r.hget(KEYS.job(job_id), "status") == "done"
        print(f"\nthe stream ended {stalled_s:.1f}s after the primary's kill")
        assert gateway.stop() == 0 and worker.stop(signal.SIGTERM) == 0
    finally:
        for proc in (gateway, worker):
            if proc.proc.poll() is None:
                proc.stop(signal.SIGKILL)
