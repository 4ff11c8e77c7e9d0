"""The cluster layout on a real Redis Cluster (three masters, ``tests/redis_topologies.py``): the
worker, ``Client``, ``AsyncClient`` and ``sluiceway bulk`` run unchanged over ``redis+cluster://``
with ``--queue-shards``; a kill -9 mid-run still ends every job exactly once; a setup the cluster
cannot run is one clear error at startup."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import signal
import time
import threading

import pytest
import redis
from click.testing import CliRunner

from bench.instant_engine import InstantEngine
from producers.aio import AsyncClient
from producers.cli import cli
from producers.client import Client
from producers.connection import UnsupportedServer, connect, is_cluster_client, parse_cluster_url
from producers.protocol import CONSUMER_GROUP, Keys
from producers.protocol.scripts import cancel_keys, submit_keys
from tests.redis_server import redis7_executable
from tests.redis_topologies import LocalCluster
from tests.worker.conftest import RunningWorker, wait_for, worker_settings
from tests.worker.test_process import WorkerProcess
from worker.cli import run_worker
from worker.loop import Worker
from worker.scripts import Scripts

SHARDS = 4
LONG = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    group = LocalCluster(redis7_executable(), tmp_path_factory.mktemp("cluster")).start()
    yield group
    group.close()


@pytest.fixture
def url(cluster) -> str:
    return "redis+cluster://" + ",".join(u.removeprefix("redis://").split("/")[0] for u in cluster.urls[:2])


@pytest.fixture
def prefix(request) -> str:
    return f"t{os.urandom(3).hex()}"  # each test its own keys on the shared cluster


@pytest.fixture
def r(url):
    with connect(url, decode_responses=True) as client:
        yield client


def start(tiny_model, url: str, prefix: str, engine=None, **overrides) -> RunningWorker:
    settings = worker_settings(tiny_model, url, prefix=prefix, queue_shards=SHARDS, celery=False, **overrides)
    return RunningWorker(Worker(settings, engine=engine if engine is not None else InstantEngine()))


def test_a_cluster_url_opens_a_cluster_client_and_bad_ones_name_the_part(url, r):
    assert is_cluster_client(r) and r.ping()
    target = parse_cluster_url("rediss+cluster://u:pw@h1:7000,[::1]?socket_timeout=3")
    assert target.nodes == (("h1", 7000), ("::1", 6379))
    assert target.options["ssl"] is True and target.options["socket_timeout"] == 3.0
    assert target.options["password"] == "pw"
    with pytest.raises(ValueError, match="has database 0 alone"):
        parse_cluster_url("redis+cluster://h1:7000/3")
    with pytest.raises(ValueError, match="cluster node port 'x'"):
        parse_cluster_url("redis+cluster://h1:x")


def test_every_script_s_keys_share_one_slot_and_the_default_layout_keeps_its_names():
    keys = Keys("sluiceway", SHARDS)
    for job_id in (f"job-{i}" for i in range(50)):
        scripts = Scripts.__new__(Scripts)
        scripts.keys = keys
        for names in (submit_keys(keys, job_id, "bulk"), cancel_keys(keys, job_id, "bulk"),
                      scripts._job_keys(job_id, "bulk")):
            assert len({redis.crc.key_slot(k.encode()) for k in names}) == 1, names
    assert len({keys.shard_of(f"job-{i}") for i in range(50)}) == SHARDS
    plain = Keys()
    assert (plain.job("a"), plain.queue("bulk"), plain.dead) == ("sluiceway:job:a", "sluiceway:queue:bulk", "sluiceway:dead")
    for layout in (Keys("a:job:b"), keys):  # the job hash key a submit writes in the entry reads back
        assert layout.job_id_of(layout.job("x:job:y")) == "x:job:y"
    assert keys.job_id_of(plain.job("x")) is None and plain.job_id_of(keys.job("x")) is None
    with pytest.raises(ValueError, match="queue_shards must be an integer from 0 to 1024"):
        Keys("sluiceway", 5000)


def test_worker_client_and_async_client_run_jobs_on_the_cluster(tiny_model, url, prefix, r):
    worker = start(tiny_model, url, prefix)
    try:
        with Client(url, prefix=prefix, queue_shards=SHARDS, socket_timeout=60) as client:
            ids = client.submit_many([{"prompt": f"job {i}", "sampling": {"max_tokens": 4}} for i in range(24)])
            ids.append(client.submit(prompt="streamed", sampling={"max_tokens": 5}, stream=True))
            text = "".join(client.stream(ids[-1], timeout=30))
            for job_id in ids[:-1]:
                assert client.result(job_id, timeout=30).usage.completion_tokens == 4
            assert client.result(ids[-1], timeout=30).outputs[0].text == text
            parked = client.submit_many([{"prompt": f"parked {i}"} for i in range(8)], queue="parked")
            assert len({Keys(prefix, SHARDS).shard_of(j) for j in parked}) > 1
            assert client.queues()["parked"].backlog == 8  # the sum of its shard streams, on every master
            cancelled = client.submit(prompt="late", queue="nobody-reads-this")
            assert client.cancel(cancelled) and client.status(cancelled).status.value == "cancelled"

        async def run_async() -> list[str]:
            async with AsyncClient(url, prefix=prefix, queue_shards=SHARDS, socket_timeout=60) as aio:
                submitted = [await aio.submit(prompt=f"async {i}", sampling={"max_tokens": 3}) for i in range(6)]
                return [(await aio.result(j, timeout=30)).usage.completion_tokens for j in submitted]

        assert asyncio.run(run_async()) == [3] * 6
    finally:
        assert worker.stop() == 0
    keys = Keys(prefix, SHARDS)
    used = {keys.shard_of(j) for j in ids}
    assert len(used) == SHARDS  # the jobs spread over every shard, each shard's stream drained
    for shard in range(SHARDS):
        assert r.xlen(keys.queue("interactive", shard)) == 0
    assert r.llen(keys.done(ids[0])) == 1 and r.hget(keys.job(ids[0]), "status") == "done"


def test_bulk_runs_unchanged_on_the_cluster(tiny_model, url, prefix, tmp_path):
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"id": f"row-{i}", "prompt": f"row {i}", "sampling": {"max_tokens": 3}}) + "\n"
                            for i in range(12)))
    out = tmp_path / "out.jsonl"
    worker = start(tiny_model, url, prefix)
    try:
        res = CliRunner().invoke(cli, ["bulk", str(rows), str(out), "--no-progress", "--timeout", "60",
                                       "--redis", url, "--prefix", prefix, "--queue-shards", str(SHARDS)])
    finally:
        assert worker.stop() == 0
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == [f"row-{i}" for i in range(12)]
    assert {line["status"] for line in lines} == {"done"}


def test_kill_9_mid_run_on_the_cluster_every_job_ends_exactly_once(tiny_model, tmp_path, url, prefix, r):
    keys = Keys(prefix, SHARDS)
    with Client(url, prefix=prefix, queue_shards=SHARDS, socket_timeout=60) as client:
        # NOTE: lengths differ, so the kill after the first end lands while the others still run
        lengths = [100 + 25 * i for i in range(6)]
        ids = client.submit_many([{"prompt": f"job {i}", "sampling": {**LONG, "max_tokens": n}}
                                  for i, n in enumerate(lengths)])
        args = ("--name", "crashy", "--prefix", prefix, "--queue-shards", str(SHARDS), "--no-celery",
                "--claim-idle-seconds", "2")
        first = WorkerProcess(tiny_model, tmp_path, *args, redis_url=url)
        try:
            wait_for(lambda: [client.status(j).status.value for j in ids].count("done") >= 1, timeout=60,
                     what="a job done")
            first.stop(signal.SIGKILL)
            running = [j for j in ids if client.status(j).status.value == "running"]
            assert running, "the kill should land while jobs run"
            second = WorkerProcess(tiny_model, tmp_path, "--name", "other", *args[2:], redis_url=url)
            try:  # another name: it claims the dead worker's entries once they go idle
                for job_id, n in zip(ids, lengths):
                    assert client.result(job_id, timeout=90).usage.completion_tokens == n
            finally:
                assert second.stop() == 0
        finally:
            first.stop(signal.SIGKILL)
    for job_id in ids:
        assert r.lrange(keys.done(job_id), 0, -1) == ["done"]
    assert {r.hget(keys.job(j), "attempts") for j in running} == {"2"}
    for shard in range(SHARDS):
        stream = keys.queue("interactive", shard)
        assert r.xlen(stream) == 0 and r.xpending(stream, CONSUMER_GROUP)["pending"] == 0


def test_what_the_cluster_cannot_run_is_one_clear_error_at_startup(tiny_model, cluster, url, prefix, capsys):
    # the cluster client without the cluster layout
    settings = worker_settings(tiny_model, url, prefix=prefix, celery=False, name="flat")
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["code"] = Worker(settings, engine=InstantEngine()).work()
        except Exception as exc:  # the refusal, raised out of start()
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the worker ran on a cluster without the cluster layout"
    assert isinstance(outcome.get("error"), UnsupportedServer), outcome
    assert "--queue-shards N" in str(outcome["error"])
    # a node reached by a single-node URL, even with the layout: named, and the CLI exits 2
    plain = worker_settings(tiny_model, cluster.urls[0], prefix=prefix, celery=False, queue_shards=SHARDS)
    assert run_worker(plain, engine=InstantEngine()) == 2
    assert "error: redis: the server is a Redis Cluster node reached by a single-node URL; give redis+cluster://" \
        in capsys.readouterr().err
    # no node of the cluster answers: one line, exit 2
    from worker.embedded_redis import free_port

    gone = worker_settings(tiny_model, f"redis+cluster://127.0.0.1:{free_port()}", prefix=prefix, celery=False,
                           queue_shards=SHARDS)
    assert run_worker(gone, engine=InstantEngine()) == 2
    assert "error: redis: Redis Cluster cannot be connected" in capsys.readouterr().err
    # a worker of another shard count than the prefix's workers run
    first = start(tiny_model, url, prefix, name="a")
    wait_for(lambda: first.worker.state == "running", what="the first worker to start")
    assert first.stop() == 0
    other = worker_settings(tiny_model, url, prefix=prefix, celery=False, queue_shards=SHARDS + 1, name="b")
    assert run_worker(other, engine=InstantEngine()) == 2
    assert f"queue_shards: this worker has {SHARDS + 1}, but the workers of prefix {prefix!r} run 'shards={SHARDS}'" \
        in capsys.readouterr().err
    # producers too: a client on a cluster without the layout, before it sends anything
    with pytest.raises(UnsupportedServer, match="give queue_shards=N"):
        Client(url, prefix=prefix)
    with pytest.raises(UnsupportedServer, match="give queue_shards=N"):
        AsyncClient(url, prefix=prefix)
    res = CliRunner().invoke(cli, ["submit", "hi", "--redis", url, "--prefix", prefix])
    assert res.exit_code == 1 and "Error: redis: a Redis Cluster needs the cluster layout" in res.output
    # Celery's transport has no cluster mode: named when asked for, off (not a crash) by default
    with pytest.raises(ValueError, match="Celery's Redis transport has no cluster mode"):
        Worker(worker_settings(tiny_model, url, prefix=prefix, queue_shards=SHARDS, celery=True,
                               celery_broker=url), engine=InstantEngine())
    assert Worker(worker_settings(tiny_model, url, prefix=prefix, queue_shards=SHARDS, celery=True),
                  engine=InstantEngine()).celery is None


def test_a_single_server_passes_the_check(redis_server):
    from producers.connection import check_server

    with connect(redis_server) as client:
        check_server(client)
        check_server(client, SHARDS)  # the cluster layout runs on one server as well


def test_the_cluster_layout_runs_on_one_server_too(tiny_model, redis_server):
    keys = Keys("one", SHARDS)
    stray = next(f"stray-{i}" for i in range(50) if keys.shard_of(f"stray-{i}") == 1)
    with redis.Redis.from_url(redis_server, decode_responses=True) as r:  # a job XADDed on another shard's stream
        r.xadd(keys.queue("bulk", 0), {"job": json.dumps({"v": 1, "id": stray, "prompt": "hi"})})
    worker = start(tiny_model, redis_server, "one")
    try:
        with Client(redis_server, prefix="one", queue_shards=SHARDS, socket_timeout=60) as client:
            ids = client.submit_many([{"prompt": f"job {i}", "sampling": {"max_tokens": 2}} for i in range(12)],
                                     queue="bulk")
            assert [client.result(j, timeout=30).usage.completion_tokens for j in ids] == [2] * 12
    finally:
        assert worker.stop() == 0
    with redis.Redis.from_url(redis_server, decode_responses=True) as r:
        names = set(r.scan_iter(match="one:*"))
        letters = [fields for _, fields in r.xrange(keys.dead_of(0))]
    assert len(letters) == 1 and letters[0]["error_code"] == "invalid_job"
    assert f"job {stray!r} belongs to shard 1 of {SHARDS}, not to shard 0" in letters[0]["error"]
    assert not r.exists(keys.job(stray))  # nothing of another slot was touched
    assert {keys.queue("bulk", s) for s in range(SHARDS)} <= names and "one:queue:bulk" not in names
    assert keys.job(ids[0]) in names and r"one:{s" in keys.job(ids[0])


def test_an_idle_worker_waits_on_every_shard_at_once_wakes_for_each_and_stops_at_once(tiny_model, cluster, url,
                                                                                        prefix):
    masters = [node.client() for node in cluster.nodes]

    def blocked() -> int:
        return sum(int(m.info("clients")["blocked_clients"]) for m in masters)

    def calls(name: str) -> int:
        return sum(int(m.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0)) for m in masters)

    worker = start(tiny_model, url, prefix, claim_idle_seconds=60.0)
    try:
        wait_for(lambda: blocked() == SHARDS, what="one blocking read per shard")
        for m in masters:
            m.config_resetstat()
        window_s = 2.0
        time.sleep(window_s)  # NOTE: a rate is counted over a length of time
        reads = calls("xreadgroup")
        # before: every shard stream swept and a 100 ms wait on one, ~9 reads per 100 ms (~180 here)
        assert reads <= 3 * SHARDS, f"{reads} XREADGROUP in {window_s}s from one idle worker on {SHARDS} shards"
        keys = Keys(prefix, SHARDS)
        with Client(url, prefix=prefix, queue="bulk", queue_shards=SHARDS, socket_timeout=30) as client:
            for shard in range(SHARDS):  # a job on any shard wakes it at once
                job_id = next(f"wake-{shard}-{i}" for i in range(200) if keys.shard_of(f"wake-{shard}-{i}") == shard)
                wait_for(lambda: blocked() == SHARDS, what="the worker waiting again")
                started = time.monotonic()
                client.submit(prompt="hi", sampling={"max_tokens": 2}, job_id=job_id)
                assert client.result(job_id, timeout=10).usage.completion_tokens == 2
                assert time.monotonic() - started < 1.0, f"a job on shard {shard} waited for the worker"
        # the cluster client reads the keys of its stream reads and scripts itself
        assert calls("command|getkeys") == 0
        wait_for(lambda: blocked() == SHARDS, what="the worker waiting again")
        started = time.monotonic()
        assert worker.stop() == 0
        assert time.monotonic() - started < 1.0, "a stop must not wait out the reads"
        assert blocked() == 0
    finally:
        if worker.thread.is_alive():
            worker.stop(immediately=True)
        for m in masters:
            m.close()


def _move_slot(masters: list, slot: int, source, target) -> None:
    """Move ``slot`` with its keys from master ``source`` to ``target``, as ``redis-cli --cluster
    reshard`` does: importing / migrating, MIGRATE of every key, then the new owner everywhere."""
    source_id, target_id = source.execute_command("CLUSTER", "MYID"), target.execute_command("CLUSTER", "MYID")
    target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    host, port = target.connection_pool.connection_kwargs["host"], target.connection_pool.connection_kwargs["port"]
    while keys := source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
        source.execute_command("MIGRATE", host, port, "", 0, 5000, "KEYS", *keys)
    for master in masters:
        master.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)


def test_a_shard_whose_slot_moves_while_the_worker_waits_is_read_on_its_new_master(tiny_model, cluster, url,
                                                                                  prefix, caplog):
    """A slot moved under an idle worker's blocked read (a reshard): the old owner lets the read
    go (UNBLOCKED, its key migrated), the worker finds the shard on its new master and jobs
    there run, with no error on the way (it once surfaced as a component error)."""
    masters = [node.client() for node in cluster.nodes]
    keys = Keys(prefix, SHARDS)
    queue = keys.queue("bulk", 0)
    slot = masters[0].execute_command("CLUSTER", "KEYSLOT", queue)
    owner = next(m for m in masters if m.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) is not None
                 and slot in _slots_of(m))
    other = next(m for m in masters if m is not owner)
    ids = [f"moved-{i}" for i in range(400) if keys.shard_of(f"moved-{i}") == 0][:3]

    def blocked() -> int:
        return sum(int(m.info("clients")["blocked_clients"]) for m in masters)

    worker = start(tiny_model, url, prefix, claim_idle_seconds=60.0)
    moved = False
    try:
        with Client(url, prefix=prefix, queue="bulk", queue_shards=SHARDS, socket_timeout=30) as client:
            client.submit(prompt="before", sampling={"max_tokens": 2}, job_id=ids[0])
            assert client.result(ids[0], timeout=10).usage.completion_tokens == 2  # the group exists on the shard
            wait_for(lambda: blocked() == SHARDS, what="one blocking read per shard")
            _move_slot(masters, slot, owner, other)
            moved = True
            for job_id in ids[1:]:
                client.submit(prompt="after", sampling={"max_tokens": 2}, job_id=job_id)
                assert client.result(job_id, timeout=15).usage.completion_tokens == 2
            assert other.exists(queue) and not owner.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)
        assert worker.stop() == 0
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors
    finally:
        if worker.thread.is_alive():
            worker.stop(immediately=True)
        if moved:
            _move_slot(masters, slot, other, owner)  # the module's other tests keep the layout they started with
        for m in masters:
            m.close()


def _slots_of(master) -> set[int]:
    me = master.execute_command("CLUSTER", "MYID")
    owned = set()
    for start_slot, end_slot, primary, *_ in master.execute_command("CLUSTER", "SLOTS"):
        if primary[2] == me:
            owned.update(range(start_slot, end_slot + 1))
    return owned


def _cluster_user(cluster, role: str, prefix: str, password: str) -> None:
    """``sluiceway acl ROLE --cluster`` applied on every master, as an operator would."""
    res = CliRunner().invoke(cli, ["acl", role, "--cluster", "--prefix", prefix, "--password", password,
                                   "--user", f"{role}-{prefix}"])
    assert res.exit_code == 0, res.output
    for node in cluster.nodes:
        with node.client(decode_responses=True) as admin:
            assert admin.execute_command(*shlex.split(res.output.strip())) == "OK"


def _refusals(cluster, prefix: str) -> list[tuple[str, str, str]]:
    """ACL LOG entries of this test's users on every master, less redis-py's CLIENT SETINFO
    (it ignores the refusal) and the cancel script's XDEL (a pcall the producer may lack)."""
    found = []
    for node in cluster.nodes:
        with node.client(decode_responses=True) as admin:
            found += [(e["username"], e["context"], e["object"]) for e in admin.execute_command("ACL", "LOG", "128")
                      if e["username"].endswith(prefix) and e["object"] not in ("client", "xdel")]
    return found


def test_the_acl_roles_run_the_cluster_layout(tiny_model, cluster, prefix):
    """A worker as the ``worker-no-celery --cluster`` user and a producer as the ``producer
    --cluster`` user run jobs over every shard; nothing they send is refused, and the tagged
    queue streams stay unreadable by the producer."""
    _cluster_user(cluster, "producer", prefix, "pw-p")
    _cluster_user(cluster, "worker-no-celery", prefix, "pw-w")
    nodes = ",".join(u.removeprefix("redis://").split("/")[0] for u in cluster.urls[:2])
    worker = start(tiny_model, f"redis+cluster://worker-no-celery-{prefix}:pw-w@{nodes}", prefix)
    try:
        with Client(f"redis+cluster://producer-{prefix}:pw-p@{nodes}", prefix=prefix, queue_shards=SHARDS,
                    socket_timeout=60) as client:
            keys = Keys(prefix, SHARDS)
            on_shard = [next(f"acl-{s}-{n}" for n in range(400) if keys.shard_of(f"acl-{s}-{n}") == s)
                        for s in range(SHARDS)]  # NOTE: chosen ids: random ones left a shard out 1 run in 10
            ids = client.submit_many([{"prompt": f"job {i}", "sampling": {"max_tokens": 4},
                                       **({"job_id": on_shard[i]} if i < SHARDS else {})} for i in range(12)])
            ids.append(client.submit(prompt="streamed", sampling={"max_tokens": 5}, stream=True))
            text = "".join(client.stream(ids[-1], timeout=30))
            assert [client.result(j, timeout=30).usage.completion_tokens for j in ids[:-1]] == [4] * 12
            assert client.result(ids[-1], timeout=30).outputs[0].text == text
            assert client.status(ids[0]).status.value == "done"
            cancelled = client.submit(prompt="late", queue="nobody-reads-this")
            assert client.cancel(cancelled) and client.status(cancelled).status.value == "cancelled"
            assert len({Keys(prefix, SHARDS).shard_of(j) for j in ids}) == SHARDS
            assert _refusals(cluster, prefix) == []
            stream = Keys(prefix, SHARDS).queue("nobody-reads-this", Keys(prefix, SHARDS).shard_of(cancelled))
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.redis.xrange(stream)
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.redis.get("elsewhere")
    finally:
        assert worker.stop() == 0
    assert sorted(_refusals(cluster, prefix)) == [(f"producer-{prefix}", "toplevel", cmd) for cmd in ("get", "xrange")]


def test_the_gateway_role_applies_on_a_cluster_and_the_single_node_roles_stay_as_they_were():
    from producers.acl import GATEWAY, PRODUCER, WORKER, setuser_args

    for role in (PRODUCER, WORKER, GATEWAY):
        plain, tagged = setuser_args(role, "acme", 7, "pw"), setuser_args(role, "acme", 7, "pw", cluster=True)
        assert not any("{*}" in a or "cluster|" in a for a in plain)
        assert "+cluster|slots" in tagged and "+command" in tagged
        assert any("~acme:{*}:job:*" in a for a in tagged)
    assert "+cluster|shards" not in setuser_args(WORKER, "acme", 6, "pw", cluster=True)
    with pytest.raises(ValueError, match="prefix must not hold"):
        setuser_args(PRODUCER, "a{b}", 7, "pw", cluster=True)
