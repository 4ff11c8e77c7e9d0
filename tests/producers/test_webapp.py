"""The FastAPI example against a real redis-server, with the worker's half played by hand."""

import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from examples.webapp.app import create_app  # noqa: E402
from producers.protocol import Status  # noqa: E402


def sse(body: str) -> list[tuple[str, dict]]:
    events = []
    for block in body.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields.get("event", "message"), json.loads(fields["data"])))
    return events


def test_enqueue_poll_stream_cancel(redis_server, peer):
    with TestClient(create_app(redis_server)) as http:
        res = http.post("/jobs", json={"prompt": "Capital of France?", "stream": True, "sampling": {"max_tokens": 8}})
        assert res.status_code == 202
        job_id = res.json()["id"]
        assert http.get(f"/jobs/{job_id}").json()["status"] == "queued"

        peer.start(job_id)
        peer.token(job_id, "Par")
        peer.token(job_id, "is.", finish_reason="stop")
        peer.finish(job_id)
        res = http.get(f"/jobs/{job_id}/stream")
        assert res.headers["content-type"].startswith("text/event-stream")
        assert sse(res.text) == [("message", {"text": "Par"}), ("message", {"text": "is."}), ("end", {"status": "done"})]
        polled = http.get(f"/jobs/{job_id}").json()
        assert polled["status"] == "done" and polled["result"]["text"] == "Paris."

        other = http.post("/jobs", json={"prompt": "x", "stream": True}).json()["id"]
        peer.start(other)
        assert http.post(f"/jobs/{other}/cancel").json()["cancel_requested"] is True
        peer.finish(other, Status.CANCELLED, error="cancelled by a client")
        assert sse(http.get(f"/jobs/{other}/stream").text) == [
            ("error", {"status": "cancelled", "error": "cancelled by a client"})
        ]
        queued = http.post("/jobs", json={"prompt": "x", "stream": True}).json()["id"]
        assert http.post(f"/jobs/{queued}/cancel").json()["cancel_requested"] is True  # ends at once
        assert sse(http.get(f"/jobs/{queued}/stream").text) == [
            ("error", {"status": "cancelled", "error": "cancelled before it started"})
        ]


def test_errors(redis_server):
    with TestClient(create_app(redis_server)) as http:
        res = http.post("/jobs", json={"prompt": "x", "sampling": {"temperature": -1}})
        assert res.status_code == 422 and "temperature must be >= 0" in res.json()["detail"]
        assert http.get("/jobs/nope").status_code == 404
