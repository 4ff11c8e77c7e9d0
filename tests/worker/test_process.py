"""The worker as a real process (``python -m worker``): kill -9, SIGTERM, its private Redis."""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from producers.celery_app import CELERY_QUEUE, generate_signature
from producers.client import Client
from producers.protocol import Keys, WorkerInfo
from tests.worker.conftest import CLIENT_KWARGS, pending_count, show_on_failure, wait_for

KEYS = Keys()
LONG = {"temperature": 0, "max_tokens": 300, "ignore_eos": True}
LOG_TAIL_LINES = 200  # of each worker's log, in the report of a test that fails


class WorkerProcess:
    """``python -m worker`` on the tiny model; output goes to a log file in ``tmp_path``."""

    def __init__(self, tiny_model, tmp_path, *args: str, redis_url: str | None = None, **env: str) -> None:
        self.log_path = tmp_path / f"worker-{os.urandom(3).hex()}.log"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
        # Settings through the environment as well as flags: both routes are in use.
        environ.update(SLUICEWAY_DEVICE="cpu", SLUICEWAY_MAX_NUM_SEQS="4", SLUICEWAY_SWAP_SPACE="0.01", **env)
        # NOTE: on a 2-core machine torch's spinning OpenMP threads starve the worker's own
        # threads and the Redis server; one compute thread is several times faster here.
        environ.setdefault("OMP_NUM_THREADS", "1")
        command = [sys.executable, "-m", "worker", "--model", str(tiny_model), *args]
        if redis_url:
            command += ["--redis", redis_url]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(command, env=environ, stdout=subprocess.PIPE, stderr=self.log)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of its log."""
        with open(self.log_path, errors="replace") as log:
            return "".join(collections.deque(log, maxlen=lines))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.proc.stdout.close()
            self.log.close()


@pytest.fixture
def spawn(tiny_model, tmp_path, request):
    """``spawn(*args, redis_url=None, **env)``: a ``WorkerProcess``, killed at teardown; a test that
    fails shows the tail of each one's log (``show_on_failure``)."""
    procs: list[WorkerProcess] = []

    def start(*args: str, **kw) -> WorkerProcess:
        proc = WorkerProcess(tiny_model, tmp_path, *args, **kw)
        procs.append(proc)
        show_on_failure(request.node, f"worker process {len(procs)} ({' '.join(args)}): "
                                      f"the last {LOG_TAIL_LINES} lines of its log", proc.tail)
        return proc

    yield start
    for proc in procs:
        if proc.proc.poll() is None:
            proc.stop(signal.SIGKILL)


def statuses(client: Client, ids: list[str]) -> list[str]:
    return [client.status(j).status.value for j in ids]


def test_kill_9_mid_run_then_restart_every_job_ends_exactly_once(spawn, redis_server, client, r):
    ids = client.submit_many([{"prompt": f"job {i}", "sampling": LONG} for i in range(24)])
    first = spawn("--name", "crashy", redis_url=redis_server)
    wait_for(lambda: statuses(client, ids).count("done") >= 2, timeout=60, what="two jobs done")
    first.stop(signal.SIGKILL)
    running_at_kill = [j for j, s in zip(ids, statuses(client, ids)) if s == "running"]
    assert running_at_kill, "the kill should land while jobs run"
    assert pending_count(r, "interactive") >= len(running_at_kill)
    second = spawn("--name", "crashy", redis_url=redis_server)  # same name: its own pending entries first
    for job_id in ids:
        assert client.result(job_id, timeout=60).usage.completion_tokens == 300
    for job_id in ids:
        assert r.lrange(KEYS.done(job_id), 0, -1) == ["done"]
    assert {r.hget(KEYS.job(j), "attempts") for j in running_at_kill} == {"2"}
    assert pending_count(r, "interactive") == 0 and r.xlen(KEYS.queue("interactive")) == 0
    assert second.stop() == 0


def test_sigterm_drains_in_flight_jobs_and_leaves_the_rest_queued(spawn, redis_server, client, r):
    ids = client.submit_many([{"prompt": f"job {i}", "sampling": LONG} for i in range(16)], queue="bulk")
    worker = spawn("--name", "drainer", "--grace-period", "60", "--checkpoint-seconds", "0.1", redis_url=redis_server)
    # NOTE: "running" is set when the job is read; a job still being tokenized when the drain
    # begins is released, not finished. A progress checkpoint means it generates in the engine.
    wait_for(lambda: any(r.hexists(KEYS.job(j), "progress") for j in ids), timeout=60, what="a job generating")
    worker.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "worker.draining" in worker.output(), timeout=60, what="the drain to begin")
    celery = pytest.importorskip("celery")
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    tasks = [generate_signature(prompt=f"task {i}", sampling=LONG, app=app).apply_async() for i in range(2)]
    worker.proc.wait(60)
    assert worker.stop() == 0
    after = statuses(client, ids)
    assert "running" not in after and "done" in after and set(after) <= {"done", "queued"}
    for job_id, status in zip(ids, after):
        assert r.llen(KEYS.done(job_id)) == (1 if status == "done" else 0)
    # The Celery consumer stopped with the drain: tasks sent since wait on their queue, none taken.
    assert [t.state for t in tasks] == ["PENDING"] * 2 and r.llen(CELERY_QUEUE) == 2 and r.hlen("unacked") == 0
    assert r.hget(KEYS.workers, "drainer") is None
    assert "worker.draining" in worker.output() and "worker.stopped" in worker.output()
    successor = spawn("--name", "successor", redis_url=redis_server)
    for job_id in ids:
        client.result(job_id, timeout=60)
        assert r.llen(KEYS.done(job_id)) == 1
    assert pending_count(r, "bulk") == 0
    assert all(t.get(timeout=60)["usage"]["completion_tokens"] == 300 for t in tasks)
    app.close()
    assert successor.stop() == 0


def test_without_redis_it_runs_a_private_server_and_stops_it(spawn):
    worker = spawn("--name", "solo", "--metrics-port", "0")
    line = worker.proc.stdout.readline().decode()
    url = re.search(r"redis://\S+", line).group(0)
    with Client(url, **CLIENT_KWARGS) as client:
        job_id = client.submit("Hello", sampling={"max_tokens": 3, "ignore_eos": True})
        assert client.result(job_id, timeout=60).usage.completion_tokens == 3
        info = WorkerInfo.model_validate_json(client.redis.hget(KEYS.workers, "solo"))
        assert info.state == "running"
    celery = pytest.importorskip("celery")
    app = celery.Celery("app", broker=url, backend=url)  # the private server is the Celery broker too
    try:
        res = generate_signature(prompt="Hello", sampling={"max_tokens": 3}, app=app).apply_async()
        assert res.get(timeout=60)["usage"]["completion_tokens"] == 3
    finally:
        app.close()
    assert worker.stop(signal.SIGINT) == 0
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()


def test_private_redis_goes_with_a_killed_worker(spawn):
    """kill -9 of a worker that started its own redis-server leaves no server behind."""
    worker = spawn("--name", "lonely", "--no-celery")
    line = worker.proc.stdout.readline().decode()
    url = re.search(r"redis://\S+", line).group(0)
    probe = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=30)
    assert probe.ping()
    worker.proc.kill()
    worker.proc.wait(30)
    try:
        probe.blpop("sluiceway:test:never", timeout=15)  # a blocked read ends when the server does
    except redis.ConnectionError:
        pass
    else:
        try:
            probe.shutdown(nosave=True)  # leave no server behind even when failing
        except redis.RedisError:
            pass
        pytest.fail("the private redis-server outlived its killed worker")


def test_a_tp2_worker_whose_model_has_no_weights_ends_with_one_line_and_leaves_nothing(tiny_model, tmp_path,
                                                                                       redis_server):
    """Rank 0 and the spawned rank both find no weights: the one-rank worker's line and exit code,
    no traceback, and no process of the worker's session left (its own session, so orphans count)."""
    model = tmp_path / "no-weights"
    shutil.copytree(tiny_model, model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
    worker = subprocess.Popen(
        [sys.executable, "-m", "sluiceway", "worker", "--model", str(model), "--device", "cpu",
         "--tensor-parallel-size", "2", "--swap-space", "0", "--redis", redis_server],
        env={**environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        out, err = worker.communicate(timeout=120)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
    assert worker.returncode == 2, err
    assert err.splitlines() == [f"error: model: no *.safetensors weights in {model}"]
    # no rank, nor anything else it started, outlives it (the spawn's resource tracker ends on its own)
    wait_for(lambda: not running_in_session(worker.pid), timeout=10, what="the worker's session to end")


def running_in_session(sid: int) -> list[int]:
    """Processes of session ``sid`` that run (not zombies waiting for their reaper)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.name.isdigit() else []
        except OSError:
            continue
        if fields and int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def run_worker_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m sluiceway worker ARGS`` with only the given ``SLUICEWAY_*`` variables set."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEWAY_")}
    return subprocess.run([sys.executable, "-m", "sluiceway", "worker", *args], env={**environ, **env},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, env, message", [
    # inf or 1e300 seconds: the intake's XAUTOCLAIM was refused at every turn, or a thread's wait raised
    (["--claim-idle-seconds", "inf"], {}, "--claim-idle-seconds (env SLUICEWAY_CLAIM_IDLE_SECONDS): Input should be"
                                          " a finite number"),
    (["--cancel-poll-seconds", "1e300"], {}, "--cancel-poll-seconds (env SLUICEWAY_CANCEL_POLL_SECONDS): Input should"
                                             " be less than or equal to 2147483647"),
    ([], {"SLUICEWAY_RESULT_TTL": str(10**20)}, "--result-ttl (env SLUICEWAY_RESULT_TTL): Input should be less than"
                                                " or equal to 2147483647"),
    (["--swap-space", "inf"], {}, "swap_space must be 'auto' or a finite number of GiB >= 0, got 'inf'"),
    (["--swap-floor-gib", "nan"], {}, "--swap-floor-gib (env SLUICEWAY_SWAP_FLOOR_GIB): Input should be a finite"),
    ([], {"SLUICEWAY_NAME": ""}, "--name (env SLUICEWAY_NAME): name must be a non-empty word without spaces, got ''"),
    (["--override-generation-config", "[1]"], {}, "--override-generation-config (env"
                                                  " SLUICEWAY_OVERRIDE_GENERATION_CONFIG): must be a JSON object, got '[1]'"),
])
def test_a_setting_out_of_range_is_a_usage_error_before_anything_starts(args, env, message, tmp_path):
    # no --redis: a private redis-server would be started (and said on stdout) were it not refused first
    run = run_worker_cli("--model", str(tmp_path / "no-model"), *args, **env)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""


def test_generation_config_overrides_are_a_json_object_as_a_flag_too(tmp_path):
    """The flag was refused as 'not a valid dictionary' whatever it held; now it passes to the model."""
    model = tmp_path / "no-model"
    for args, env in ((["--override-generation-config", '{"temperature": 0.5}'], {}),
                      ([], {"SLUICEWAY_OVERRIDE_GENERATION_CONFIG": '{"temperature": 0.5}'})):
        run = run_worker_cli("--model", str(model), "--redis", "redis://127.0.0.1:1/0", *args, **env)
        assert run.returncode == 2 and run.stderr.splitlines() == [f"error: model: model folder '{model}' does not exist"]


def test_a_metrics_endpoint_it_cannot_listen_on_is_one_line_before_the_engine_loads(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        run = run_worker_cli("--model", str(tmp_path / "no-model"), "--metrics-host", "127.0.0.1",
                             "--metrics-port", str(port))
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [f"error: metrics_port: cannot bind to {port} on 127.0.0.1 (Address already in use)"]
    run = run_worker_cli("--model", str(tmp_path / "no-model"), "--metrics-host", "no-such-host.invalid",
                         "--metrics-port", "9400")
    assert run.returncode == 2 and run.stderr.startswith("error: metrics_host: 'no-such-host.invalid' cannot be resolved (")
    assert run.stdout == ""  # refused before a private redis-server was started
