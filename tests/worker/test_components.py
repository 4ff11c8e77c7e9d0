"""The worker's parts on their own: Redis scripts, heartbeat, metrics, settings and CLI."""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import threading
import time
import urllib.request

import pytest
from click.testing import CliRunner

from bench.instant_engine import InstantEngine
import engine.gc_pauses as gc_pauses
from engine.config import EngineArgs
from producers.protocol import CONSUMER_GROUP, Job, Keys
from tests.worker.conftest import worker_settings
from worker.admission import Admission, Held, Work
from worker.cli import run_worker, worker_command
from worker.engine_host import EngineHost, EngineLike
from worker.heartbeat import Heartbeat, NameInUse
from worker.loop import Worker
from worker.metrics import Metrics
from worker.scripts import Scripts
from worker.settings import WorkerSettings

KEYS = Keys()
QUEUE = KEYS.queue("interactive")


def delivered(r, consumer: str, n: int) -> list[str]:
    """Push ``n`` jobs and deliver them to ``consumer``; return the entry ids."""
    r.xgroup_create(QUEUE, CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(n):
        r.xadd(QUEUE, {"job": json.dumps({"v": 1, "id": f"job-{i}", "prompt": "x"})})
    reply = r.xreadgroup(CONSUMER_GROUP, consumer, {QUEUE: ">"}, count=n)
    return [entry_id for _, entries in reply for entry_id, _ in entries]


def test_a_job_ends_once_however_often_it_is_finished(r):
    scripts = Scripts(r, KEYS, "w1")
    (entry,) = delivered(r, "w1", 1)
    common = dict(job_id="job-0", queue="interactive", entry_id=entry, now=time.time(), ttl=60, stream=True)
    assert scripts.finish(r, status="done", result='{"id": "job-0"}', **common) == 1
    assert scripts.finish(r, status="failed", error="late duplicate", **common) == 0
    assert scripts.finish(r, status="cancelled", finish_reason="cancelled", **common) == 0
    job = r.hgetall(KEYS.job("job-0"))
    assert job["status"] == "done" and "error" not in job and job["result"] == '{"id": "job-0"}'
    assert r.lrange(KEYS.done("job-0"), 0, -1) == ["done"]
    assert r.xlen(KEYS.tokens("job-0")) == 0  # a normal end adds no closing entry
    assert r.xpending(QUEUE, CONSUMER_GROUP)["pending"] == 0 and r.xlen(QUEUE) == 0


def test_start_settles_ended_cancelled_and_duplicate_entries(r):
    scripts = Scripts(r, KEYS, "w1")
    entries = delivered(r, "w1", 3)
    start = dict(queue="interactive", now=time.time(), enqueued_at=1.0, max_attempts=3, ttl=60, stream=False, raw="{}")
    reply = scripts.start(r, job_id="job-0", entry_id=entries[0], **start)
    assert reply[0] == "start" and reply[1] == "1" and reply[2] == "1.0"
    assert scripts.start(r, job_id="job-0", entry_id=entries[1], **start)[0] == "duplicate"  # another entry, same id
    r.set(KEYS.cancel("job-2"), "1")
    assert scripts.start(r, job_id="job-2", entry_id=entries[2], **start)[0] == "cancelled"
    assert r.hget(KEYS.job("job-2"), "status") == "cancelled" and not r.exists(KEYS.cancel("job-2"))
    scripts.finish(r, job_id="job-0", queue="interactive", entry_id=entries[0], status="done", now=1.0, ttl=60,
                   stream=False)
    r.xadd(QUEUE, {"job": "{}"})
    (again,) = [e for _, es in r.xreadgroup(CONSUMER_GROUP, "w1", {QUEUE: ">"}) for e, _ in es]
    assert scripts.start(r, job_id="job-0", entry_id=again, **start) == ["ended", "done"]
    assert r.xpending(QUEUE, CONSUMER_GROUP)["pending"] == 0


def test_a_queued_job_cancelled_after_a_worker_read_its_entry_is_dropped_unrun(r, client):
    """The cancel script ends the job and deletes its entry; the worker that already holds the
    entry (read, not started) finds it ended and only acknowledges it."""
    r.xgroup_create(QUEUE, CONSUMER_GROUP, id="0", mkstream=True)
    job_id = client.submit("x", stream=True)
    ((_, ((entry, fields),)),) = r.xreadgroup(CONSUMER_GROUP, "w1", {QUEUE: ">"}, count=1)
    assert client.cancel(job_id) is True
    assert r.xlen(QUEUE) == 0  # out of the backlog at once
    scripts = Scripts(r, KEYS, "w1")
    start = dict(queue="interactive", now=time.time(), enqueued_at=1.0, max_attempts=3, ttl=60, stream=True,
                 raw=fields["job"])
    assert scripts.start(r, job_id=job_id, entry_id=entry, **start) == ["ended", "cancelled"]
    assert r.xpending(QUEUE, CONSUMER_GROUP)["pending"] == 0
    assert r.hget(KEYS.job(job_id), "attempts") == "0" and r.lrange(KEYS.done(job_id), 0, -1) == ["cancelled"]


def test_heartbeat_resets_idle_time_only_of_entries_still_owned(r):
    mine, stolen = delivered(r, "w1", 2)
    r.xclaim(QUEUE, CONSUMER_GROUP, "w2", 0, [stolen], idle=50_000, justid=True)  # another worker took it
    r.xclaim(QUEUE, CONSUMER_GROUP, "w1", 0, [mine], idle=50_000, justid=True)
    held = Held()
    for i, entry in enumerate((mine, stolen)):
        held.add(Work(job=Job(id=f"job-{i}", prompt="x"), sink=None, queue="interactive", entry_id=entry))
    scripts = Scripts(r, KEYS, "w1")
    info = Heartbeat.worker_info("w1", ("interactive",), "tiny", stale_after_s=30)
    beat = Heartbeat(r, KEYS, scripts, held, 1.0, lambda: {"in_flight": len(held)}, info)
    beat.tick()
    pending = {p["message_id"]: p for p in r.xpending_range(QUEUE, CONSUMER_GROUP, "-", "+", 10)}
    assert pending[mine]["consumer"] == "w1" and pending[mine]["time_since_delivered"] < 5_000
    assert pending[stolen]["consumer"] == "w2" and pending[stolen]["time_since_delivered"] >= 50_000
    record = json.loads(r.hget(KEYS.workers, "w1"))
    assert record["in_flight"] == 2 and record["last_seen"] >= info.started_at
    beat.stop()
    assert r.hget(KEYS.workers, "w1") is None


def test_metrics_are_served_over_http():
    metrics = Metrics(port=0, host="127.0.0.1")
    metrics.start()
    try:
        metrics.job_ended("done")
        metrics.dead_lettered.inc()
        metrics.observe_backlog({"bulk": (7, 2)})

        class Stats:
            num_running, num_preemptions, swap_pool_bytes, num_generation_tokens = 3, 4, 1 << 30, 100

        metrics.observe_engine(Stats())
        gc.collect()  # a full collection while started: timed into the histogram
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=5).read().decode()
    finally:
        metrics.stop()
    for line in ('sluiceway_jobs_finished_total{status="done"} 1.0', "sluiceway_jobs_dead_lettered_total 1.0",
                 'sluiceway_queue_depth{queue="bulk"} 7.0', 'sluiceway_queue_pending{queue="bulk"} 2.0',
                 "sluiceway_engine_running 3.0", "sluiceway_engine_preemptions_total 4.0",
                 "sluiceway_swap_pool_bytes 1.073741824e+09"):
        assert line in body
    full = [ln for ln in body.splitlines() if ln.startswith('sluiceway_gc_pause_seconds_count{generation="2"}')]
    assert full and float(full[0].split()[-1]) >= 1
    gc.collect()  # stopped: no longer timed
    assert metrics.gc_pause.labels("2")._sum.get() == sum(
        float(ln.split()[-1]) for ln in body.splitlines() if ln.startswith('sluiceway_gc_pause_seconds_sum{generation="2"}'))


def test_every_engine_argument_is_a_flag_and_no_test_knob_is():
    help_text = CliRunner().invoke(worker_command, ["--help"], terminal_width=200).output
    for f in dataclasses.fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in help_text and f"SLUICEWAY_{f.name.upper()}" in help_text
    assert WorkerSettings(model="m", max_num_seqs=7).engine_kwargs()["max_num_seqs"] == 7
    # the swap pool's cap in blocks was a knob of the engine's tests: a test now sizes swap_space
    assert "--max-cpu-blocks-override" not in help_text
    with pytest.raises(ValueError, match="unknown engine argument"):
        EngineArgs.from_kwargs("m", max_cpu_blocks_override=3)


def test_settings_come_from_flags_over_the_environment(monkeypatch):
    monkeypatch.setenv("SLUICEWAY_MODEL", "from-env")
    monkeypatch.setenv("SLUICEWAY_QUEUES", "bulk, interactive")
    monkeypatch.setenv("SLUICEWAY_CLAIM_IDLE_SECONDS", "12")
    monkeypatch.setenv("SLUICEWAY_MAX_NUM_SEQS", "64")
    monkeypatch.setenv("SLUICEWAY_REDIS_URL", "redis://queue-host:6379/0")
    settings = WorkerSettings(model="from-flag")
    assert settings.model == "from-flag" and settings.queues == ("bulk", "interactive")
    assert settings.claim_idle_seconds == 12 and settings.heartbeat_seconds == 3
    assert settings.redis == "redis://queue-host:6379/0"
    kwargs = settings.engine_kwargs()
    assert kwargs["max_num_seqs"] == 64 and "block_size" not in kwargs  # unset: the engine's default
    assert kwargs["swap_space"] == settings.swap_floor_gib  # auto starts at the floor
    assert WorkerSettings(model="m", swap_space="2.5").engine_kwargs()["swap_space"] == 2.5


@pytest.mark.parametrize("args, message", [
    ([], "--model (env SLUICEWAY_MODEL)"),
    (["--model", "m", "--swap-space", "lots"], "swap_space must be 'auto' or a number of GiB, got 'lots'"),
    (["--model", "m", "--queues", "a,,b"], "queues must be non-empty names"),
    (["--model", "m", "--max-attempts", "0"], "--max-attempts"),
    (["--model", "m", "--block-size", "3"], "block_size must be a power of two"),
    (["--model", "m", "--device", "tpu"], "'tpu' is not one of"),
    # checks of several fields name the one their message names (were "settings: ...")
    (["--model", "m", "--prefix", ""], "--prefix (env SLUICEWAY_PREFIX): prefix must be a non-empty word"),
    (["--model", "m", "--swap-floor-gib", "5", "--swap-cap-gib", "1"],
     "--swap-cap-gib (env SLUICEWAY_SWAP_CAP_GIB): swap_cap_gib (1.0) must be >= swap_floor_gib (5.0)"),
])
def test_the_cli_names_the_bad_flag(args, message, monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("SLUICEWAY_"):
            monkeypatch.delenv(name)
    result = CliRunner().invoke(worker_command, args)
    assert result.exit_code == 2 and message in result.output


def test_the_cli_lists_every_setting():
    help_text = CliRunner().invoke(worker_command, ["--help"]).output
    for name in WorkerSettings.model_fields:
        assert "--" + name.replace("_", "-") in help_text
    assert "SLUICEWAY_CLAIM_IDLE_SECONDS" in help_text


def test_the_health_check_reads_the_loop_heartbeat():
    from worker.healthcheck import check

    metrics = Metrics(port=0, host="127.0.0.1")
    metrics.start()
    try:
        metrics.loop_alive.set(time.time())
        assert check(metrics.port, max_age=60) is None
        metrics.loop_alive.set(time.time() - 120)
        assert "last turned 120s ago" in check(metrics.port, max_age=60)
    finally:
        metrics.stop()
    assert "no metrics endpoint" in check(metrics.port, max_age=60)


def test_the_compose_file_runs_persistent_redis_and_a_gpu_worker():
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    services = yaml.safe_load((root / "docker-compose.yml").read_text())["services"]
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    worker = services["worker"]
    assert worker["build"] == "." and (root / "Dockerfile").is_file()
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "worker.healthcheck" in worker["healthcheck"]["test"]
    assert any(v.endswith(":/models:ro") for v in worker["volumes"])
    settings = set(WorkerSettings.model_fields)
    for name in worker["environment"]:
        if name.startswith("SLUICEWAY_"):
            assert name.removeprefix("SLUICEWAY_").lower() in settings, name


def test_a_name_held_by_a_live_worker_elsewhere_is_refused(r):
    scripts = Scripts(r, KEYS, "gpu-1")
    me = Heartbeat.worker_info("gpu-1", ("interactive",), "tiny", stale_after_s=30)
    beat = Heartbeat(r, KEYS, scripts, Held(), 1.0, dict, me)
    beat.check_name_free()  # nobody holds it
    other = me.model_copy(update={"host": "elsewhere", "pid": 4242, "last_seen": time.time()})
    r.hset(KEYS.workers, "gpu-1", other.model_dump_json())
    with pytest.raises(NameInUse, match="in use by a live worker on elsewhere"):
        beat.check_name_free()
    r.hset(KEYS.workers, "gpu-1", other.model_copy(update={"last_seen": time.time() - 31}).model_dump_json())
    beat.check_name_free()  # stale: that worker died
    dead_here = other.model_copy(update={"host": me.host, "pid": 2 ** 22 + 17})
    r.hset(KEYS.workers, "gpu-1", dead_here.model_dump_json())
    beat.check_name_free()  # a previous process of this host that is gone (kill -9, then restart)


def test_the_dockerfile_copies_what_exists_and_its_base_meets_the_torch_floor():
    """No Docker daemon runs in CI, so the build is checked by reading: every COPY source
    exists, the base image's torch satisfies pyproject's floor, and the entry point and the
    healthcheck are what the package provides."""
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    dockerfile = (root / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            assert all((root / s).exists() for s in sources), line
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    floor = next(d for d in project["optional-dependencies"]["worker"] if d.startswith("torch"))
    wanted = tuple(int(x) for x in re.search(r">=([\d.]+)", floor).group(1).split("."))
    base = re.search(r"^FROM pytorch/pytorch:(\d+)\.(\d+)\.(\d+)", dockerfile, re.M)
    assert base and tuple(int(x) for x in base.groups())[: len(wanted)] >= wanted, (base, floor)
    assert 'ENTRYPOINT ["sluiceway", "worker"]' in dockerfile and "sluiceway" in project["scripts"]
    assert '"-m", "worker.healthcheck"' in dockerfile and (root / "worker" / "healthcheck.py").is_file()


def test_capacity_is_worker_policy_over_the_engine_count_of_sequences(make_engine):
    """The engine only says how many sequences it holds; the worker keeps up to twice
    ``max_num_seqs`` of them in it (and a reserve for the first queue), counting every
    completion of a request with n > 1."""
    from engine import SamplingParams

    engine = make_engine(max_num_seqs=3)
    host = EngineHost(engine, Metrics())
    assert host.top_queue_reserve == 1
    assert engine.num_unfinished_seqs() == 0 and host.capacity() == 7
    engine.add_request("pair", [5, 6, 7], SamplingParams(n=2, max_tokens=2, temperature=0.0))
    engine.add_request("one", [5, 6], SamplingParams(max_tokens=1))
    assert engine.num_unfinished_seqs() == 3 and host.capacity() == 4
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_unfinished_seqs() == 0 and host.capacity() == 7


def test_a_cancel_waits_in_admission_once_until_its_job_is_no_longer_held():
    admission, held = Admission(), Held()
    work = Work(job=Job.model_validate({"v": 1, "id": "j1", "prompt": "x"}), sink=None)
    held.add(work)
    assert admission.cancel("j1", "cancelled by a client")
    assert not admission.cancel("j1", "revoked through Celery")  # asked again: still the one cancel
    assert admission.take_cancels() == {"j1": "cancelled by a client"}
    assert admission.take_cancels() == {}  # handed to the step loop once
    assert admission.cancel_reason("j1") == "cancelled by a client"  # applied when the job is taken
    admission.forget_cancels(held)
    assert admission.cancel_reason("j1") == "cancelled by a client"  # still held
    held.discard(work)
    admission.forget_cancels(held)
    assert admission.cancel_reason("j1") is None



def test_a_turn_takes_the_highest_rank_first_and_a_bounded_number_of_prompt_tokens():
    """A backlog of long bulk prompts is admitted a few per step-loop turn, and an interactive
    job handed in after them goes first at the next turn (it waited behind all of them)."""
    admission = Admission()
    admission.set_capacity(100)
    job = lambda i, priority: Job.model_validate(  # noqa: E731
        {"v": 1, "id": f"j{i}", "prompt_token_ids": [1] * 4096, "priority": priority})
    bulk = [Work(job=job(i, 0), sink=None) for i in range(6)]
    admission.offer(bulk)
    interactive = Work(job=Job.model_validate({"v": 1, "id": "chat", "prompt_token_ids": [1] * 256,
                                               "priority": 10}), sink=None)
    admission.offer([interactive])
    assert [w.id for w in admission.take(100, max_tokens=8192)] == ["chat", "j0"]  # 256 + 4,096 tokens
    assert [w.id for w in admission.take(100, max_tokens=8192)] == ["j1", "j2"]
    assert [w.id for w in admission.take(1, max_tokens=8192)] == ["j3"]  # the job limit still holds
    assert [w.id for w in admission.take(100, max_tokens=100)] == ["j4"]  # one at least, whatever its size
    assert [w.id for w in admission.take(100)] == ["j5"]


def test_the_read_ahead_bounds_what_is_handed_in_and_not_yet_taken():
    """A worker starting on a backlog reads a few turns' worth, not the whole capacity at once."""
    admission = Admission(read_ahead=3)
    admission.set_capacity(100)
    assert admission.room() == 3
    works = [Work(job=Job.model_validate({"v": 1, "id": f"j{i}", "prompt": "x"}), sink=None) for i in range(3)]
    admission.offer(works)
    assert admission.room() == 0 and admission.wait_for_room(0.01) == 0
    assert len(admission.take(2)) == 2
    assert admission.room() == 2 and admission.wait_for_room(0.01) == 2
    admission.set_capacity(1)  # the capacity still bounds it: one handed in already
    assert admission.room() == 0


def test_closing_admission_wakes_the_reader_and_the_preparer_at_once():
    admission = Admission(prepare=True)
    woke: dict[str, float] = {}

    def wait(name, call):
        started = time.monotonic()
        call()
        woke[name] = time.monotonic() - started

    threads = [threading.Thread(target=wait, args=("reader", lambda: admission.wait_for_room(30))),
               threading.Thread(target=wait, args=("preparer", lambda: admission.next_to_prepare(30)))]
    for t in threads:
        t.start()
    admission.close()
    for t in threads:
        t.join(20)
    assert set(woke) == {"reader", "preparer"} and max(woke.values()) < 10  # not the 30 s timeout


def test_the_worker_uses_the_engine_through_engine_like_alone(start_worker, client, engine):
    members = {name for name in vars(EngineLike) if not name.startswith("_")} | set(EngineLike.__annotations__)

    class OnlyEngineLike:
        def __init__(self, engine) -> None:
            self._engine = engine

        def __getattr__(self, name):
            if name not in members:
                raise AttributeError(f"the worker reached past EngineLike for {name!r}")
            return getattr(self._engine, name)

    handle = start_worker(OnlyEngineLike(engine))
    job = client.submit(messages=[{"role": "user", "content": "Hi"}], sampling={"max_tokens": 3, "ignore_eos": True})
    assert client.result(job, timeout=20).usage.completion_tokens == 3
    assert handle.worker.swap is not None and handle.worker.preparer is not None
    assert handle.stop() == 0


def test_the_reader_parses_no_bulk_job_while_the_engine_launches(client, make_engine, tiny_model, redis_server):
    """The reader takes the engine's launch lock around the parse of each entry of a later queue
    (worker/intake.py): while a step is scheduled or launched (the lock held) no bulk job is
    parsed, so the launch never waits on the reader for the GIL; the batch waits, and an
    interactive job submitted meanwhile is read at once (the express lane admits it mid-launch);
    released, the bulk entries are read."""
    import threading
    import time

    from tests.worker.conftest import wait_for, worker_settings
    from worker.loop import Worker

    engine = make_engine(max_num_seqs=8)
    sampling = {"max_tokens": 2}
    bulk = client.submit_many(({"prompt_token_ids": [5 + i] * 8, "sampling": sampling} for i in range(3)),
                              queue="bulk")
    worker = Worker(worker_settings(tiny_model, redis_server), engine=engine)
    assert worker.intake.launch_lock is engine.launch_lock
    read_bulk, stop = threading.Event(), threading.Event()

    def read():
        deadline = time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline:
            worker.intake.tick()  # the reader's own pending entries, the claim round, then new entries
            if all(job in worker.held for job in bulk):
                read_bulk.set()
                return

    reader = threading.Thread(target=read, daemon=True)
    try:
        worker.admission.set_capacity(worker.engine.capacity())
        with engine.launch_lock:  # as a step's launch holds it
            reader.start()
            wait_for(lambda: worker.intake._deferred, what="the bulk batch deferred")
            urgent = client.submit(prompt_token_ids=[9, 8, 7], sampling=sampling, queue="interactive")
            wait_for(lambda: urgent in worker.held, what="the interactive job read during the launch")
            assert not any(job in worker.held for job in bulk), "a bulk job was parsed during a launch"
        assert read_bulk.wait(20) and not worker.intake._deferred
    finally:
        stop.set()
        reader.join(10)
        worker.admission.close()
        worker.intake._waiter.close()
        worker.redis.close()


def test_bulk_entries_left_unparsed_at_a_stop_go_to_the_next_claim(client, r, make_engine, tiny_model, redis_server):
    """Entries a launch kept the reader from parsing are pending to it; stopping, it hands them
    back idle, so any live worker's next claim takes them at once."""
    import threading

    from tests.worker.conftest import wait_for, worker_settings
    from worker.loop import Worker
    from worker.scripts import RELEASE_IDLE_MS

    engine = make_engine(max_num_seqs=8)
    client.submit_many(({"prompt_token_ids": [5 + i] * 8, "sampling": {"max_tokens": 2}} for i in range(3)),
                       queue="bulk")
    worker = Worker(worker_settings(tiny_model, redis_server), engine=engine)
    launching, launched = threading.Event(), threading.Event()

    def launch():  # a step launch on the step loop's thread, holding the lock until told
        with engine.launch_lock:
            launching.set()
            launched.wait(30)

    step_loop = threading.Thread(target=launch, daemon=True)
    try:
        worker.admission.set_capacity(worker.engine.capacity())
        step_loop.start()
        launching.wait(10)
        for _ in range(4):  # the reader's own pending entries, the claim round, then new entries
            worker.intake.tick()
            if worker.intake._deferred:
                break
        assert sum(len(entries) for _, _, entries in worker.intake._deferred) == 3
        launched.set()
        worker.admission.close()
        worker.intake.stop()
        pending = r.xpending_range(KEYS.queue("bulk"), CONSUMER_GROUP, "-", "+", 10)
        assert len(pending) == 3 and all(p["time_since_delivered"] >= RELEASE_IDLE_MS for p in pending)
        assert len(worker.held) == 0
    finally:
        launched.set()
        worker.admission.close()
        worker.redis.close()


def test_a_worker_refused_at_start_gives_back_the_frozen_heap_and_the_switch_interval(tiny_model, redis_server, r):
    # a live worker of the same name on another host: work() raises NameInUse before anything runs
    settings = worker_settings(tiny_model, redis_server, name="taken", celery=False)
    other = Heartbeat.worker_info("taken", ("interactive",), "tiny", stale_after_s=30)
    other = other.model_copy(update={"host": "elsewhere", "pid": 4242, "last_seen": time.time()})
    r.hset(settings.keys.workers, "taken", other.model_dump_json())
    holders, interval = gc_pauses._frozen_by, sys.getswitchinterval()
    threads = set(threading.enumerate())
    worker = Worker(settings, engine=InstantEngine())
    with pytest.raises(NameInUse, match="in use by a live worker on elsewhere"):
        worker.work()
    assert gc_pauses._frozen_by == holders
    assert sys.getswitchinterval() == interval
    assert worker.state == "draining"
    assert {t for t in threading.enumerate() if t.name.startswith("sluiceway-")} <= threads  # none started


def test_a_celery_config_that_does_not_load_is_named_before_the_model_loads(monkeypatch, tiny_model):
    for name in list(__import__("os").environ):
        if name.startswith("SLUICEWAY_"):
            monkeypatch.delenv(name)
    built = []
    monkeypatch.setattr("worker.loop.build_engine", lambda kwargs: built.append(kwargs) or InstantEngine())
    result = CliRunner().invoke(worker_command, ["--model", str(tiny_model), "--device", "cpu",
                                                 "--celery-config", "no_such_module:config"])
    assert result.exit_code == 2, result.output
    assert "celery_config: cannot load 'no_such_module:config'" in result.output
    assert built == []  # refused before the engine was built
    assert "Traceback" not in result.output


def test_a_worker_whose_parts_refuse_a_setting_shuts_down_the_engine_it_built(monkeypatch, tiny_model, redis_server):
    class Recorded(InstantEngine):
        shut = 0

        def shutdown(self) -> None:
            Recorded.shut += 1
            super().shutdown()

    monkeypatch.setattr("worker.loop.build_engine", lambda kwargs: Recorded())
    bad = worker_settings(tiny_model, redis_server, celery_config="no_such_module:config")
    with pytest.raises(ValueError, match="celery_config: cannot load"):
        Worker(bad)
    assert Recorded.shut == 1
    # through the CLI's runner: one line and exit 2, not a traceback
    assert run_worker(bad) == 2
    assert Recorded.shut == 2


def test_a_model_that_cannot_be_found_is_one_line_and_exit_2(tmp_path, redis_server, capsys):
    assert run_worker(worker_settings(tmp_path / "no-such-model", redis_server)) == 2
    assert f"error: model: model folder '{tmp_path / 'no-such-model'}' does not exist" in capsys.readouterr().err


def test_a_broker_url_celery_cannot_use_is_named_not_taken_for_a_missing_celery(tiny_model, redis_server):
    bad = worker_settings(tiny_model, redis_server, celery_broker="bogus://user:secret@broker-host/0")
    with pytest.raises(ValueError, match=r"celery_broker / celery_backend: Celery cannot use bogus://user:\*\*\*@broker-host/0") \
            as refused:
        Worker(bad, engine=InstantEngine())
    assert "secret" not in str(refused.value)


def test_a_redis_url_the_worker_cannot_open_names_the_setting(tiny_model, capsys):
    assert run_worker(worker_settings(tiny_model, "redis://host:notaport/0"), engine=InstantEngine()) == 2
    assert "error: redis: Port could not be cast to integer value as 'notaport'" in capsys.readouterr().err


def test_engine_settings_the_model_cannot_take_are_one_line_and_exit_2(tiny_model, redis_server, capsys):
    assert run_worker(worker_settings(tiny_model, redis_server, max_model_len=999_999)) == 2
    assert "error: max_model_len (999999) exceeds the model's context length" in capsys.readouterr().err
    assert run_worker(worker_settings(tiny_model, redis_server, tensor_parallel_size=3)) == 2
    assert "error: tensor_parallel_size (3) must divide the model's 4 attention heads" in capsys.readouterr().err


def test_a_redis_outage_is_logged_when_it_starts_again_while_it_lasts_and_when_it_ends(caplog):
    """A real client on a port nothing listens on: one ``redis.unavailable``, then a reminder
    every ``still_down_log_s`` while it lasts (was: one line, then silence however long it went
    on), then ``redis.reconnected`` once a tick gets through."""
    import logging
    import socket

    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from tests.worker.conftest import wait_for
    from worker.component import Component

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there

    class Pinger(Component):
        name = "pinger"
        still_down_log_s = 0.2
        backoff_cap_s = 0.2
        up = False

        def tick(self):
            if not self.up:
                redis.Redis(port=port, retry=Retry(NoBackoff(), 0)).ping()  # NOTE: redis-py retries 4 s by default

    def said(what):
        return [r for r in caplog.records if r.getMessage() == what and r.fields["component"] == "pinger"]

    caplog.set_level(logging.INFO, logger="worker.component")
    pinger = Pinger(interval=0.01)
    pinger.start()
    try:
        wait_for(lambda: len(said("redis.still_unavailable")) >= 2, timeout=30, what="two reminders")
        pinger.up = True
        wait_for(lambda: said("redis.reconnected"), timeout=30, what="the reconnection")
    finally:
        pinger.stop()
    assert len(said("redis.unavailable")) == 1
    downs = [r.fields["down_s"] for r in said("redis.still_unavailable")]
    assert downs == sorted(downs) and "Connection refused" in said("redis.still_unavailable")[0].fields["error"]


@pytest.mark.parametrize("held_elsewhere", [True, False], ids=["name-held", "name-free"])
def test_a_worker_started_before_redis_checks_its_name_once_redis_answers(tiny_model, engine, tmp_path,
                                                                        held_elsewhere):
    """The worker starts while its Redis is not up yet (it skipped the start checks then; its
    heartbeat then overwrote a live worker's record of the same name and its reader shared that
    worker's pending entries). Now nothing reads jobs or writes the record until the checks pass
    once Redis answers: a name a live worker holds stops it (exit 2) with that worker's record
    and the queued job untouched; a free name runs the job."""
    from producers.client import Client
    from producers.embedded_redis import EmbeddedRedis, free_port
    from tests.worker.conftest import CLIENT_KWARGS, RunningWorker, wait_for

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    handle = RunningWorker(Worker(worker_settings(tiny_model, url, name="gpu-dup", claim_idle_seconds=2.0),
                                  engine=engine))
    # NOTE: up behind a password first (the worker's NOAUTH counts as Redis away), so the record
    # and the job are in place before the worker can look: no race with its checks
    server = EmbeddedRedis(tmp_path / "redis", port=port, password="not-yet")
    try:
        time.sleep(0.5)  # the worker has started its loop without Redis
        assert handle.thread.is_alive()
        server.start()
        r = server.client(decode_responses=True)
        other = Heartbeat.worker_info("gpu-dup", ("interactive",), "tiny", stale_after_s=3600)
        other = other.model_copy(update={"host": "elsewhere", "pid": 4242})
        if held_elsewhere:
            r.hset(KEYS.workers, "gpu-dup", other.model_dump_json())
        with Client(server.url, **CLIENT_KWARGS) as client:
            job = client.submit("Hello", sampling={"max_tokens": 3})
            time.sleep(0.3)
            assert handle.thread.is_alive() and r.hget(KEYS.workers, "gpu-dup") == (
                other.model_dump_json() if held_elsewhere else None)
            r.config_set("requirepass", "")  # now the worker gets in
            if held_elsewhere:
                assert handle.wait(timeout=60) == 2
                assert "worker name 'gpu-dup' is in use by a live worker on elsewhere" in handle.worker.refusal
                assert r.hget(KEYS.workers, "gpu-dup") == other.model_dump_json()  # neither rewritten nor deleted
                assert client.status(job).status.value == "queued"
                groups = r.xinfo_groups(KEYS.queue("interactive"))  # nothing read: no group made, or none pending
                assert all(g["pending"] == 0 for g in groups) and r.xlen(KEYS.queue("interactive")) == 1
            else:
                assert client.result(job, timeout=60).usage.completion_tokens == 3
                wait_for(lambda: r.hget(KEYS.workers, "gpu-dup") is not None, what="the worker's record")
                assert handle.stop() == 0
        r.close()
    finally:
        if handle.thread.is_alive():
            handle.stop(immediately=True)
        server.cleanup()
