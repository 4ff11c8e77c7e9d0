"""Fixtures of the gateway suite: one real stack for the whole package.

A private redis-server, a worker process on the tiny model (``--served-model-name tiny``),
and a gateway process (``python -m gateway``: real uvicorn on a free port) with two tenants,
``alice`` (at most two unanswered requests) and ``bob``. Two more models are worker records
written by hand, as a worker writes them: ``parked`` (live, but nothing reads its queue:
requests to it wait, which the 429 / 504 / tenant-limit tests need) and ``gone`` (every
worker of it dead: 503).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from producers.embedded_redis import EmbeddedRedis, free_port
from producers.protocol import Keys, WorkerInfo
from tests.worker.conftest import tiny_model, wait_for  # noqa: F401  (the session's tiny model)
from tests.worker.test_process import WorkerProcess

KEYS = Keys()
ALICE, BOB = "key-alice", "key-bob"
MAX_BACKLOG = 300  # above the 256 concurrent streams of test_resilience
MODEL = "tiny"


class GatewayProcess:
    """``python -m gateway`` on a free port; its output goes to a log file."""

    def __init__(self, tmp_path: Path, redis_url: str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"gateway-{self.port}.log"
        self.log = open(self.log_path, "wb")
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
        command = [sys.executable, "-m", "gateway", "--redis", redis_url, "--port", str(self.port),
                   "--models-refresh-seconds", "0.2", *args]
        self.proc = subprocess.Popen(command, env=environ, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self._healthy, timeout=60, what=f"the gateway on port {self.port}")

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the gateway exited with {self.proc.returncode}: {self.output()[-2000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            self.log.close()


def hand_record(name: str, model: str, queues: list[str], *, alive: bool) -> str:
    now = time.time()
    seen = now if alive else now - 3600
    return WorkerInfo(name=name, host="elsewhere", pid=1, queues=queues, model=model, served_model_name=model,
                      started_at=seen, last_seen=seen, stale_after_s=3600 if alive else 30).model_dump_json()


class Stack:
    """The running stack; ``restart_worker`` replaces the worker (same name, so it resumes its jobs)."""

    def __init__(self, model_dir: Path, tmp_path: Path) -> None:
        self.model_dir = model_dir
        self.tmp_path = tmp_path
        self.redis_server = EmbeddedRedis(tmp_path / "redis").start()
        self.redis_url = self.redis_server.url
        self.r = redis.Redis.from_url(self.redis_url, decode_responses=True)
        self.r.hset(KEYS.workers, mapping={"parked-1": hand_record("parked-1", "parked", ["parked"], alive=True),
                                           "gone-1": hand_record("gone-1", "gone", ["gone"], alive=False)})
        self.worker = self.start_worker()
        self.gateway = GatewayProcess(tmp_path, self.redis_url, "--api-key", f"alice={ALICE}", "--api-key",
                                      f"bob={BOB}", "--tenant-max-outstanding", "alice=2",
                                      "--max-backlog", str(MAX_BACKLOG))
        wait_for(self._model_listed, timeout=120, what="the worker's model in /v1/models")

    def start_worker(self) -> WorkerProcess:
        return WorkerProcess(self.model_dir, self.tmp_path, "--name", "gw-worker", "--served-model-name", MODEL,
                             "--max-num-seqs", "32", "--no-celery", "--claim-idle-seconds", "2",
                             "--cancel-poll-seconds", "0.05", redis_url=self.redis_url)

    def restart_worker(self) -> None:
        self.worker = self.start_worker()

    def _model_listed(self) -> bool:
        if self.worker.proc.poll() is not None:
            raise AssertionError(f"the worker exited: {self.worker.output()[-2000:]}")
        reply = httpx.get(self.gateway.url + "/v1/models", headers={"Authorization": f"Bearer {ALICE}"})
        return MODEL in [m["id"] for m in reply.json()["data"]]

    def close(self) -> None:
        self.gateway.stop()
        if self.worker.proc.poll() is None:
            self.worker.stop(signal.SIGKILL)
        self.r.close()
        self.redis_server.kill()
        self.redis_server.cleanup()


@pytest.fixture(scope="package")
def stack(tiny_model, tmp_path_factory) -> Iterator[Stack]:  # noqa: F811
    running = Stack(tiny_model, tmp_path_factory.mktemp("gateway"))
    yield running
    running.close()


@pytest.fixture(scope="package")
def offline(tiny_model):  # noqa: F811
    """The offline engine on the same model, for the greedy reference."""
    from engine import LLM

    llm = LLM(model=str(tiny_model), device="cpu", max_num_seqs=4, swap_space=0.01)
    yield llm
    llm.llm_engine.shutdown()
