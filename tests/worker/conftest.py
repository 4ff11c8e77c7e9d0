"""Fixtures of the worker suite: a tiny local model, a CPU engine, workers run in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from producers.client import Client
from producers.protocol import CONSUMER_GROUP, Keys
from worker.loop import Worker
from worker.settings import WorkerSettings

ENGINE_ARGS = dict(device="cpu", max_num_seqs=4, swap_space=0.01, seed=0)


def wait_for(predicate: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> object:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


# What a test that fails shows beside its traceback: (title, a reader of the text), read only then.
ON_FAILURE = pytest.StashKey[list[tuple[str, Callable[[], str]]]]()


def show_on_failure(item: pytest.Item, title: str, read: Callable[[], str]) -> None:
    """If ``item``'s test fails (in its setup, call or teardown), its report shows ``read()`` under
    ``title``, once: a worker process's log, say, which no one reads once the test has ended."""
    item.stash.setdefault(ON_FAILURE, []).append((title, read))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed:
        for title, read in item.stash.get(ON_FAILURE, []):
            try:
                text = read()
            except OSError as exc:
                text = f"(unreadable: {exc})"
            report.sections.append((title, text))
        item.stash[ON_FAILURE] = []
    return report


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from engine.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("worker-tiny") / "model", arch="llama")


@pytest.fixture(scope="session")
def make_engine(tiny_model):
    """``make_engine(**engine_args)``: a CPU engine on the tiny model, shut down at the end."""
    from engine import EngineArgs, LLMEngine

    engines = []

    def make(**overrides):
        engine = LLMEngine(EngineArgs(model=str(tiny_model), **{**ENGINE_ARGS, **overrides}))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def worker_settings(tiny_model: Path, url: str, **overrides) -> WorkerSettings:
    base = dict(model=str(tiny_model), redis=url, name="w1", device="cpu", claim_idle_seconds=30.0,
                cancel_poll_seconds=0.05, grace_period=10.0, swap_space="auto", swap_floor_gib=0.001,
                swap_cap_gib=0.01)
    return WorkerSettings(**{**base, **overrides})


class SlowEngine:
    """The real engine, with every step taking at least ``step_s``: long jobs on a tiny model."""

    def __init__(self, engine, step_s: float = 0.005) -> None:
        self._engine = engine
        self.step_s = step_s

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        time.sleep(self.step_s)  # NOTE: simulated GPU time, not a wait for a condition
        return self._engine.step()


class RunningWorker:
    """A ``Worker`` whose loop runs in a thread, as the CLI runs it in the main thread."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run, name=f"test-worker-{worker.settings.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.exit_code = self.worker.work()

    def stop(self, immediately: bool = False, timeout: float = 30.0) -> int | None:
        self.worker.request_stop(immediately=immediately)
        return self.wait(timeout)

    def wait(self, timeout: float = 30.0) -> int | None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "worker did not stop"
        return self.exit_code


@pytest.fixture
def start_worker(tiny_model, engine, redis_server) -> Iterator[Callable[..., RunningWorker]]:
    """``start_worker(engine=None, url=None, **settings)``: a worker in a thread, stopped at teardown."""
    running: list[RunningWorker] = []

    def start(engine_=None, url: str | None = None, **overrides) -> RunningWorker:
        settings = worker_settings(tiny_model, url or redis_server, **overrides)
        handle = RunningWorker(Worker(settings, engine=engine_ if engine_ is not None else engine))
        running.append(handle)
        return handle

    yield start
    for handle in running:
        if handle.thread.is_alive():
            handle.stop(immediately=True)


# NOTE: redis-py 8 reads with a 5 s socket timeout unless told otherwise; a client that waits
# longer on a done signal needs a longer one.
CLIENT_KWARGS = dict(socket_timeout=120)


@pytest.fixture
def client(redis_server) -> Iterator[Client]:
    with Client(redis_server, **CLIENT_KWARGS) as c:
        yield c


@pytest.fixture
def r(redis_server) -> Iterator[redis.Redis]:
    """A str-returning redis-py client on the test server."""
    c = redis.Redis.from_url(redis_server, decode_responses=True)
    yield c
    c.close()


def pending_count(r: redis.Redis, queue: str, keys: Keys | None = None) -> int:
    keys = keys or Keys()
    try:
        return r.xpending(keys.queue(queue), CONSUMER_GROUP)["pending"]
    except redis.ResponseError:
        return 0
