"""A real stack for the Batch API tests: a private redis-server, a worker process on the tiny
model (``--served-model-name tiny``), and gateway processes (``sluiceway serve`` on free ports)
that can be killed with SIGKILL and started again, with two tenants, ``alice`` and ``bob``.

NOTE: its own Redis rather than the package's ``stack``: every gateway on a Redis feeds its
batches, so the package's gateway would take leases the kill test means for its own pair."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import redis

from producers.protocol import Keys, WorkerInfo
from tests.redis_server import EmbeddedRedis, free_port
from tests.worker.conftest import wait_for
from tests.worker.test_process import WorkerProcess

KEYS = Keys()
ALICE, BOB = "key-alice", "key-bob"
MODEL = "tiny"
PARKED = "parked"  # a live worker record whose queue nobody reads: its jobs wait


class GatewayProcess:
    """``python -m gateway`` (``sluiceway serve``) on a free port; ``env`` sets its ``SLUICEWAY_BATCH_*``."""

    def __init__(self, tmp_path: Path, redis_url: str, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"gateway-{self.port}.log"
        self.log = open(self.log_path, "wb")
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
        environ.update(env)
        command = [sys.executable, "-m", "gateway", "--redis", redis_url, "--port", str(self.port),
                   "--models-refresh-seconds", "0.2", "--api-key", f"alice={ALICE}", "--api-key", f"bob={BOB}"]
        self.proc = subprocess.Popen(command, env=environ, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self._healthy, timeout=60, what=f"the gateway on port {self.port}")

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the gateway exited with {self.proc.returncode}: {self.output()[-2000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def client(self, key: str = ALICE) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(30)
        finally:
            self.log.close()


def parked_record() -> str:
    now = time.time()
    return WorkerInfo(name="parked-1", host="elsewhere", pid=1, queues=[PARKED], model=PARKED,
                      served_model_name=PARKED, started_at=now, last_seen=now, stale_after_s=3600).model_dump_json()


class BatchStack:
    """Redis, one worker, and gateways started on demand (``gateway()``), all stopped by ``close``."""

    def __init__(self, tiny_model: Path, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.redis_server = EmbeddedRedis(tmp_path / "redis").start()
        self.redis_url = self.redis_server.url
        self.r = redis.Redis.from_url(self.redis_url, decode_responses=True)
        self.r.hset(KEYS.workers, "parked-1", parked_record())
        self.worker = WorkerProcess(tiny_model, tmp_path, "--name", "batch-worker", "--served-model-name", MODEL,
                                    "--max-num-seqs", "64", "--no-celery", "--cancel-poll-seconds", "0.05",
                                    redis_url=self.redis_url)
        self.gateways: list[GatewayProcess] = []
        wait_for(lambda: "batch-worker" in self.r.hgetall(KEYS.workers), timeout=120, what="the worker's heartbeat")

    def gateway(self, **env: str) -> GatewayProcess:
        env = {"SLUICEWAY_BATCH_POLL_SECONDS": "0.05", "SLUICEWAY_BATCH_LEASE_SECONDS": "1", **env}
        gateway = GatewayProcess(self.tmp_path, self.redis_url, **env)
        self.gateways.append(gateway)
        return gateway

    def close(self) -> None:
        for gateway in self.gateways:
            if gateway.proc.poll() is None:
                gateway.stop(signal.SIGKILL)
        if self.worker.proc.poll() is None:
            self.worker.stop(signal.SIGKILL)
        self.r.close()
        self.redis_server.kill()
        self.redis_server.cleanup()
