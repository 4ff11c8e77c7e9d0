"""Producer round trips through a real worker: a tiny local model on the CPU engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from producers.aio import AsyncClient
from producers.bulk import Bulk
from producers.celery_app import TASK_NAME, generate_signature
from producers.client import Client
from producers.errors import JobCancelled, JobFailed
from producers.protocol import Status

pytest.importorskip("torch")
worker_loop = pytest.importorskip("worker.loop")
worker_settings = pytest.importorskip("worker.settings")

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The URL of a private redis-server that a running worker drains."""
    from engine import EngineArgs, LLMEngine
    from engine.models.tiny import build_tiny_model
    from worker.embedded_redis import EmbeddedRedis

    model = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    engine = LLMEngine(EngineArgs(model=str(model), device="cpu", max_num_seqs=8, swap_space=0.01, seed=0))
    settings = worker_settings.WorkerSettings(
        model=str(model), redis=server.url, name="producers-e2e", device="cpu", cancel_poll_seconds=0.05,
        swap_space="0.01", grace_period=5.0,  # NOTE: Celery on by default, on this Redis
    )
    worker = worker_loop.Worker(settings, engine=engine)
    thread = threading.Thread(target=worker.work, daemon=True)
    thread.start()
    yield server.url
    worker.request_stop(immediately=True)
    thread.join(30)
    server.cleanup()


@pytest.fixture
def client(live):
    with Client(live) as c:
        yield c


def test_result_of_a_real_job(client):
    job_id = client.submit("What is the capital of France?", sampling=GREEDY, metadata={"row": 3})
    result = client.result(job_id, timeout=60)
    assert result.id == job_id and result.metadata == {"row": 3}
    assert result.usage.completion_tokens == 8 and result.outputs[0].finish_reason == "length"
    assert result.text == result.outputs[0].text
    status = client.status(job_id)
    assert status.status is Status.DONE and status.worker == "producers-e2e" and status.attempts == 1
    again = client.submit("What is the capital of France?", sampling=GREEDY, job_id=job_id)
    assert again == job_id and client.result(job_id).text == result.text  # ended: not run again


def test_streamed_deltas_add_up_to_the_result(client):
    job_id = client.submit("Hello, world!", sampling={**GREEDY, "max_tokens": 24}, stream=True)
    deltas = list(client.stream_deltas(job_id, timeout=60))
    assert deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == client.result(job_id).text
    assert sum(len(d.token_ids) for d in deltas) == 24


def test_cancel_a_running_job(client):
    job_id = client.submit("Tell me a story", sampling={**GREEDY, "max_tokens": 400}, stream=True)
    stream = client.stream(job_id, timeout=60)
    next(stream)  # the job is running
    assert client.cancel(job_id) is True
    with pytest.raises(JobCancelled):
        for _ in stream:
            pass
    assert client.status(job_id).status is Status.CANCELLED


def test_async_client_round_trip(live):
    async def main():
        async with AsyncClient(live) as client:
            ids = await client.submit_many([{"prompt": f"Question {i}", "sampling": GREEDY} for i in range(4)])
            results = await asyncio.gather(*(client.result(i, timeout=60) for i in ids))
            assert [r.id for r in results] == ids
            streamed = await client.submit("Numbers:", sampling=GREEDY, stream=True)
            text = "".join([t async for t in client.stream(streamed, timeout=60)])
            assert text == (await client.result(streamed)).text

    asyncio.run(main())


def test_bulk_end_to_end(client, tmp_path):
    rows = [{"prompt": f"Grade answer {i}", "sampling": GREEDY, "metadata": {"row": i}} for i in range(30)]
    rows[4] = {"prompt": "bad", "sampling": {"max_tokens": 0}}
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = Bulk(client, tmp_path / "in.jsonl", tmp_path / "out.jsonl", max_outstanding=6, progress=False).run()
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["line"] for r in out] == list(range(1, 31))
    assert summary.done == 29 and summary.invalid == 1 and summary.completion_tokens == 29 * 8
    assert all(r["metadata"] == {"row": i} for i, r in enumerate(out) if i != 4)
    assert out[4]["status"] == "invalid" and "max_tokens" in out[4]["error"]
    again = Bulk(client, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False).run()
    assert again.kept == 30 and again.done == 0  # a finished run has nothing left to do


@pytest.fixture
def celery_app(live):
    celery = pytest.importorskip("celery")
    app = celery.Celery("app", broker=live, backend=live)
    yield app
    app.close()


def test_celery_task_round_trip(celery_app, client):
    res = generate_signature(prompt="What is the capital of France?", sampling=GREEDY, metadata={"k": 1},
                             app=celery_app).apply_async()
    result = res.get(timeout=60)
    assert res.state == "SUCCESS" and result["id"] == res.id and result["metadata"] == {"k": 1}
    assert result["usage"]["completion_tokens"] == 8
    plain = client.result(client.submit("What is the capital of France?", sampling=GREEDY), timeout=60)
    assert result["text"] == plain.text  # the same job through either door


def test_celery_progress_then_revoke(celery_app):
    res = generate_signature(prompt="Tell me a story", sampling={**GREEDY, "max_tokens": 500},
                             app=celery_app).apply_async()
    deadline = time.monotonic() + 30
    while res.state != "PROGRESS":
        assert time.monotonic() < deadline, f"no PROGRESS state, got {res.state}"
        time.sleep(0.02)
    assert res.info["text"] and res.info["completion_tokens"] > 0
    res.revoke()
    celery = pytest.importorskip("celery")
    with pytest.raises(celery.exceptions.TaskRevokedError):
        res.get(timeout=30)


def test_celery_task_with_a_bad_field_fails_with_the_field(celery_app):
    res = celery_app.send_task(TASK_NAME, kwargs={"prompt": "x", "sampling": {"temperature": -1}}, queue="sluiceway")
    with pytest.raises(JobFailed, match="temperature must be >= 0"):
        res.get(timeout=30)
