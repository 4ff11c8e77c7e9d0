"""Fixtures of the gateway suite: one real stack for the whole package, and one on a Redis Cluster.

A private redis-server, a worker process on the tiny model (``--served-model-name tiny``),
and a gateway process (``python -m gateway``: real uvicorn on a free port) with two tenants,
``alice`` (at most two unanswered requests) and ``bob``, and auto tool choice (``hermes`` for
``tiny``, its own parser; ``llama3_json`` for every other model).
Two more models are worker records written by hand, as a worker writes them: ``parked``
(live, but nothing reads its queue: requests to it wait, which the 429 / 504 / tenant-limit
tests need) and ``gone`` (every worker of it dead: 503).

``cluster_stack`` is the same on a three-master ``LocalCluster`` in the cluster layout
(``--queue-shards``), started by the first test that asks for it; ``any_stack`` runs a test
on each of the two.
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
import openai
import pytest

from producers.connection import connect
from producers.embedded_redis import EmbeddedRedis, free_port
from producers.protocol import PROTOCOL_REVISION, Keys, WorkerInfo
from tests.redis_server import redis7_executable
from tests.redis_topologies import LocalCluster
from tests.worker.conftest import tiny_model, wait_for  # noqa: F401  (the session's tiny model)
from tests.worker.test_process import WorkerProcess

KEYS = Keys()
ALICE, BOB = "key-alice", "key-bob"
STOP_S = 45
MAX_BACKLOG = 300  # above the 256 concurrent streams of test_resilience
MODEL = "tiny"
SHARDS = 4  # the cluster stack's --queue-shards
TENANTS = ("--api-key", f"alice={ALICE}", "--api-key", f"bob={BOB}")


class GatewayProcess:
    """``python -m gateway`` (``sluiceway serve``) on a free port, with ``args``; ``env`` adds
    variables (``SLUICEWAY_BATCH_*``, say); its output goes to a log file."""

    def __init__(self, tmp_path: Path, redis_url: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"gateway-{self.port}.log"
        self.log = open(self.log_path, "wb")
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
        environ.update(env or {})
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

    def client(self, key: str = ALICE) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            # NOTE: uvicorn gives open requests 30 s (gateway/cli.py), then the app's own shutdown
            # runs: a stop within that is the gateway's contract, not a hang
            return self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            # NOTE: say what the gateway was waiting for, as far as its log tells (uvicorn names
            # the connections or tasks a graceful shutdown waits on), and leave no process behind
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"the gateway did not exit within {STOP_S} s of signal {sig}; its log ends:\n"
                                 f"{self.output()[-4000:]}") from None
        finally:
            self.log.close()


def hand_record(name: str, model: str, queues: list[str], *, alive: bool,
                protocol: str | None = PROTOCOL_REVISION) -> str:
    """A worker's heartbeat as it writes it: of protocol ``protocol`` (None: a worker from before
    1.1, whose heartbeat has no such field)."""
    now = time.time()
    seen = now if alive else now - 3600
    return WorkerInfo(name=name, host="elsewhere", pid=1, queues=queues, model=model, served_model_name=model,
                      started_at=seen, last_seen=seen, stale_after_s=3600 if alive else 30,
                      protocol=protocol).model_dump_json(exclude_none=True)


def cluster_url(cluster: LocalCluster) -> str:
    """A ``redis+cluster://`` URL naming two of the cluster's three nodes (it finds the third)."""
    return "redis+cluster://" + ",".join(u.removeprefix("redis://").split("/")[0] for u in cluster.urls[:2])


class WorkerStack:
    """Redis (a private server, or a ``LocalCluster`` in the cluster layout), one worker process
    and the gateways ``start_gateway()`` starts, all stopped by ``close``; ``restart_worker`` replaces
    the worker (same name, so it resumes its jobs)."""

    def __init__(self, model_dir: Path, tmp_path: Path, *worker_args: str, name: str = "gw-worker",
                 cluster: LocalCluster | None = None, records: dict[str, str] | None = None) -> None:
        self.model_dir = model_dir
        self.tmp_path = tmp_path
        self.name = name
        self.worker_args = worker_args
        self.cluster = cluster
        self.shards = SHARDS if cluster is not None else 0
        self.layout = ("--queue-shards", str(self.shards)) if self.shards else ()
        self.keys = Keys(KEYS.prefix, self.shards)
        if cluster is None:
            self.redis_server = EmbeddedRedis(tmp_path / "redis").start()
            self.redis_url = self.redis_server.url
        else:
            self.redis_url = cluster_url(cluster)
        self.r = connect(self.redis_url, decode_responses=True)
        if records:
            self.r.hset(self.keys.workers, mapping=records)
        self.gateways: list[GatewayProcess] = []
        self.worker = self.start_worker()

    def start_worker(self) -> WorkerProcess:
        return WorkerProcess(self.model_dir, self.tmp_path, "--name", self.name, "--served-model-name", MODEL,
                             "--no-celery", "--cancel-poll-seconds", "0.05", *self.layout, *self.worker_args,
                             redis_url=self.redis_url)

    def restart_worker(self) -> None:
        self.worker = self.start_worker()

    def start_gateway(self, *args: str, **env: str) -> GatewayProcess:
        gateway = GatewayProcess(self.tmp_path, self.redis_url, *self.layout, *TENANTS, *args, env=env)
        self.gateways.append(gateway)
        return gateway

    def model_listed(self) -> bool:
        if self.worker.proc.poll() is not None:
            raise AssertionError(f"the worker exited: {self.worker.output()[-2000:]}")
        return MODEL in [m.id for m in self.gateways[0].client().models.list().data]

    def close(self) -> None:
        for gateway in self.gateways:
            if gateway.proc.poll() is None:
                gateway.stop(signal.SIGKILL)
        if self.worker.proc.poll() is None:
            self.worker.stop(signal.SIGKILL)
        self.r.close()
        if self.cluster is not None:
            self.cluster.close()
        else:
            self.redis_server.kill()
            self.redis_server.cleanup()


class Stack(WorkerStack):
    """The package's stack: its worker and its one gateway (``stack.gateway``), the hand-made records."""

    def __init__(self, model_dir: Path, tmp_path: Path, cluster: LocalCluster | None = None) -> None:
        records = {"parked-1": hand_record("parked-1", "parked", ["parked"], alive=True),
                   "gone-1": hand_record("gone-1", "gone", ["gone"], alive=False)}
        super().__init__(model_dir, tmp_path, "--max-num-seqs", "32", "--claim-idle-seconds", "2",
                         cluster=cluster, records=records)
        self.gateway = self.start_gateway("--tenant-max-outstanding", "alice=2", "--max-backlog", str(MAX_BACKLOG),
                                          "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                                          "--tool-call-parser", f"{MODEL}=hermes")
        wait_for(self.model_listed, timeout=120, what="the worker's model in /v1/models")


@pytest.fixture(scope="package")
def stack(tiny_model, tmp_path_factory) -> Iterator[Stack]:  # noqa: F811
    running = Stack(tiny_model, tmp_path_factory.mktemp("gateway"))
    yield running
    running.close()


@pytest.fixture(scope="package")
def cluster_stack(tiny_model, tmp_path_factory) -> Iterator[Stack]:  # noqa: F811
    """``stack`` on a Redis Cluster: worker and gateway with ``--queue-shards``, a ``redis+cluster://`` URL."""
    work = tmp_path_factory.mktemp("gateway-cluster")
    running = Stack(tiny_model, work, cluster=LocalCluster(redis7_executable(), work / "cluster").start())
    yield running
    running.close()


@pytest.fixture(params=["single", "cluster"])
def any_stack(request) -> Stack:
    """The test runs on the single-server stack, then on the cluster stack."""
    return request.getfixturevalue("stack" if request.param == "single" else "cluster_stack")


@pytest.fixture(scope="package")
def offline(tiny_model):  # noqa: F811
    """The offline engine on the same model, for the greedy reference."""
    from engine import LLM

    llm = LLM(model=str(tiny_model), device="cpu", max_num_seqs=4, swap_space=0.01)
    yield llm
    llm.llm_engine.shutdown()
