"""A bulk run whose Redis goes away: ``--timeout`` bounds the wait for it, OUT stays right, a re-run resumes."""

import subprocess
import sys
import threading
import time
from contextlib import closing

import pytest

from producers.bulk import Bulk
from producers.bulk_openai import OpenAIBulk
from producers.bulk_output import BulkError
from producers.client import Client
from producers.jobs import Outage
from producers.protocol import Status
from tests.producers.peer import HandWorker, Peer
from tests.producers.test_bulk import queued_ids, read_out, write_in
from tests.producers.test_bulk_openai import completion


def test_timeout_bounds_a_run_whose_redis_stops_and_out_is_left_to_resume(redis_server_factory, tmp_path):
    """Redis gone while the run submits: it rode the outage for ~30 s whatever its --timeout."""
    server = redis_server_factory(appendonly=True, appendfsync="always")
    write_in(tmp_path / "in.jsonl", [{"prompt": p, "id": f"row-{p}"} for p in "abc"])
    out_path = tmp_path / "out.jsonl"
    with Client(server.url) as client, closing(Peer(server.url)) as peer:
        for job_id, status in (("row-a", Status.DONE), ("row-b", Status.EXPIRED), ("row-c", Status.DONE)):
            client.submit("x", job_id=job_id, queue="bulk")
            peer.finish(job_id, status)
        Bulk(client, tmp_path / "in.jsonl", out_path, progress=False).run()
        before = out_path.read_bytes()
        peer.redis.client_pause(60_000, all=False)  # writes wait: the retry's submission is held
        command = [sys.executable, "-m", "producers.cli", "bulk", str(tmp_path / "in.jsonl"), str(out_path),
                   "--redis", server.url, "--no-progress", "--retry-failed", "--timeout", "2"]
        run = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        try:
            peer.wait_blocked()
            server.kill()
            stopped = time.monotonic()
            _, stderr = run.communicate(timeout=20)
            # NOTE: the run's 2 s began before Redis stopped; riding the outage took 30 s or more.
            # 10 s leaves room for a loaded machine (3.2 s seen with the suite and more beside it)
            assert time.monotonic() - stopped < 10, stderr
        finally:
            run.kill()
    lines = stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, stderr
    assert "redis did not answer before the run's timeout (2s) ran out" in lines[0] and "run again" in lines[0]
    assert out_path.read_bytes() == before

    server.start()
    with Client(server.url) as client, HandWorker(server.url):
        summary = Bulk(client, tmp_path / "in.jsonl", out_path, retry_failed=True, progress=False).run()
        assert summary.complete and summary.done == 1 and queued_ids(client).count("row-b.r1") == 1
    assert [(r["id"], r["status"]) for r in read_out(out_path)] == [("row-a", "done"), ("row-b.r1", "done"),
                                                                      ("row-c", "done")]


def test_timeout_bounds_an_openai_run_whose_redis_is_away(redis_server_factory, tmp_path):
    server = redis_server_factory()
    write_in(tmp_path / "in.jsonl", [completion("c0", "hi")])
    with Client(server.url) as client:
        server.stop()
        started = time.monotonic()
        with pytest.raises(BulkError, match=r"before the run's timeout \(0.5s\) ran out .*run again to resume"):
            OpenAIBulk(client, tmp_path / "in.jsonl", tmp_path / "out.jsonl", timeout=0.5).run()
        assert time.monotonic() - started < 2
    assert (tmp_path / "out.jsonl").read_bytes() == b""


def test_redis_away_when_the_timeout_runs_out_ends_the_run_with_its_error(redis_server_factory, tmp_path):
    """As Client.result: the rows' state is unknown, so it is not told as a timeout (stopped early)."""
    server = redis_server_factory()
    write_in(tmp_path / "in.jsonl", [{"prompt": "a"}])
    errors: list[Exception] = []

    def run(bulk: Bulk) -> None:
        try:
            bulk.run()
        except Exception as exc:
            errors.append(exc)

    with Client(server.url) as client, closing(Peer(server.url)) as peer:
        thread = threading.Thread(target=run, args=(Bulk(client, tmp_path / "in.jsonl", tmp_path / "out.jsonl",
                                                         timeout=1, progress=False),))
        thread.start()
        peer.wait_blocked()  # on the row's done signal
        server.kill()
        thread.join(5)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], BulkError)
    assert "before the run's timeout (1s) ran out" in str(errors[0])


@pytest.mark.parametrize("kind", [Bulk, OpenAIBulk])
def test_a_run_rides_an_outage_for_one_window_however_its_calls_nest(kind, monkeypatch, redis_server_factory,
                                                                      tmp_path):
    """Redis gone for good during a run without --timeout: the run ends after one outage window.
    It rode submit_many's window, then a window of its own (~60 s for 30 s windows)."""
    window = 0.7  # the backoff looks at 0.35 s, then 0.75 s: one window ends at 0.75 s, two at ~1.5 s
    monkeypatch.setattr(Outage.__init__, "__defaults__", (window, None))
    server = redis_server_factory()
    rows = [{"prompt": "a"}] if kind is Bulk else [completion("c0", "hi")]
    write_in(tmp_path / "in.jsonl", rows)
    with Client(server.url) as client:
        server.stop()
        started = time.monotonic()
        with pytest.raises(BulkError, match="redis did not answer for .*run again to resume"):
            kind(client, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False).run()
        assert window <= time.monotonic() - started < 1.2
