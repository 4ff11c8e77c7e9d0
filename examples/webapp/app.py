"""A small web app in front of Sluiceway: enqueue, poll, and stream over Server-Sent Events.

    SLUICEWAY_REDIS_URL=redis://localhost:6379/0 uvicorn examples.webapp.app:app

    curl -s localhost:8000/jobs -d '{"prompt": "Hello", "stream": true}' -H 'content-type: application/json'
    curl -N localhost:8000/jobs/<id>/stream
    curl -s localhost:8000/jobs/<id>
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from producers.aio import AsyncClient
from producers.errors import InvalidJob, JobError, JobNotFound, Timeout

STREAM_TIMEOUT_S = 300.0


class JobRequest(BaseModel):
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    metadata: dict[str, Any] = Field(default_factory=dict)


def create_app(redis_url: str | None = None, prefix: str = "sluiceway", queue: str = "interactive") -> FastAPI:
    """The app, talking to the Redis at ``redis_url`` (default: ``$SLUICEWAY_REDIS_URL``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.sluiceway = AsyncClient(redis_url, prefix=prefix, queue=queue)
        yield
        await app.state.sluiceway.close()

    app = FastAPI(title="Sluiceway example", lifespan=lifespan)

    def client(request: Request) -> AsyncClient:
        return request.app.state.sluiceway

    @app.post("/jobs", status_code=202)
    async def enqueue(body: JobRequest, request: Request) -> dict[str, str]:
        try:
            job_id = await client(request).submit(
                body.prompt, messages=body.messages, sampling=body.sampling, stream=body.stream, metadata=body.metadata
            )
        except InvalidJob as exc:
            raise HTTPException(422, str(exc)) from None
        return {"id": job_id}

    @app.get("/jobs/{job_id}")
    async def poll(job_id: str, request: Request) -> dict[str, Any]:
        """The job's status; its result once it is done."""
        try:
            status = await client(request).status(job_id)
        except JobNotFound as exc:
            raise HTTPException(404, str(exc)) from None
        reply: dict[str, Any] = {"id": job_id, "status": status.status.value, "error": status.error}
        if status.status.value == "done":
            reply["result"] = (await client(request).result(job_id, timeout=0)).model_dump()
        return reply

    @app.get("/jobs/{job_id}/stream")
    async def stream(job_id: str, request: Request) -> StreamingResponse:
        """Server-Sent Events: ``data: {"text": ...}`` per delta, then ``event: end`` or ``event: error``."""
        return StreamingResponse(_events(client(request), job_id), media_type="text/event-stream")

    @app.post("/jobs/{job_id}/cancel")
    async def cancel(job_id: str, request: Request) -> dict[str, Any]:
        return {"id": job_id, "cancel_requested": await client(request).cancel(job_id)}

    return app


async def _events(client: AsyncClient, job_id: str) -> AsyncIterator[str]:
    try:
        async for text in client.stream(job_id, timeout=STREAM_TIMEOUT_S):
            yield _event({"text": text})
    except JobError as exc:
        yield _event({"status": exc.status, "error": exc.error}, "error")
    except (JobNotFound, Timeout) as exc:
        yield _event({"error": str(exc)}, "error")
    else:
        yield _event({"status": "done"}, "end")


def _event(data: dict[str, Any], name: str | None = None) -> str:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data)}\n\n"


app = create_app()
