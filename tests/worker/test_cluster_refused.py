"""A worker pointed at a Redis Cluster node (real, three masters) refuses to start with a clear
error: the cluster layout is not implemented, and without it every job would meet MOVED or
CROSSSLOT at run time."""

from __future__ import annotations

import threading

import pytest

from bench.instant_engine import InstantEngine
from producers.connection import UnsupportedServer
from tests.redis_server import redis7_executable
from tests.redis_topologies import LocalCluster
from tests.worker.conftest import worker_settings
from worker.cli import run_worker
from worker.loop import Worker


@pytest.fixture
def cluster(tmp_path):
    group = LocalCluster(redis7_executable(), tmp_path / "cluster").start()
    yield group
    group.close()


def test_a_worker_on_a_cluster_node_stops_at_startup_naming_the_cluster(cluster, tmp_path, capsys):
    settings = worker_settings(tmp_path, cluster.urls[0], name="clustered", celery=False)
    worker = Worker(settings, engine=InstantEngine())
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["code"] = worker.work()
        except Exception as exc:  # the refusal, raised out of start()
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():
        worker.request_stop(immediately=True)
        thread.join(30)
        pytest.fail("the worker ran on a Redis Cluster node")
    assert isinstance(outcome.get("error"), UnsupportedServer), outcome
    assert "Redis Cluster" in str(outcome["error"]) and "not implemented" in str(outcome["error"])
    # the command line says it in one line and exits 2, as for a name in use
    assert run_worker(settings, engine=InstantEngine()) == 2
    assert "error: redis: the server is a Redis Cluster node" in capsys.readouterr().err


def test_a_single_server_passes_the_check(redis_server):
    from producers.connection import check_standalone, connect

    with connect(redis_server) as r:
        check_standalone(r)
