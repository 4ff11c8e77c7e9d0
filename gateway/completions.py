"""``POST /v1/completions`` and ``POST /v1/chat/completions``: one protocol job per prompt.

The request is checked (400), its tenant (401), its model (404 / 503), the protocol revision
the live workers of its queue speak (400 for a field of a later one than any of them: ``tools``
where one speaks 1.2; checked here alone, from the model directory's read of the heartbeats),
the queue's backlog and the tenant's outstanding requests (429); then its jobs (a chat's one,
a completions request's one per prompt, submitted together) go onto the model's queue and the
answer comes from the jobs' done signals, or, streamed, from their token streams read by offset
(``producers.aio.AsyncClient``), so a worker that dies mid-stream is invisible here: the
worker that resumes a job continues the same stream. A client that leaves cancels the
request's jobs, and so does a job that fails (the request fails with its error, as vLLM
fails the whole request); a request that outlives ``--request-timeout`` gets 504 and its
jobs are cancelled.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.errors import APIError, invalid_value, job_error, timeout_error
from gateway.request_body import json_body
from gateway.state import Gateway, gateway_of, tenant_of
from gateway.streaming import StreamRun, cancel_jobs, client_left
from gateway.tenants import Tenant
from gateway.translate import Endpoint, OpenAIRequest, translate_request, translate_results
from producers.errors import JobError, JobNotFound, Timeout
from producers.protocol import Job

router = APIRouter()

QUEUE_HEADER = "x-sluiceway-queue"  # interactive | bulk: which of the model's queues
PRIORITY_HEADER = "x-sluiceway-priority"  # an integer; higher runs first
TIMEOUT_HEADER = "x-sluiceway-timeout"  # seconds this request may wait, at most --request-timeout
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED = 499  # the status logged for a client that left (it never sees it)
DEADLINE_SLACK_S = 1.0


@router.post("/v1/completions")
async def create_completion(request: Request, tenant: Tenant = Depends(tenant_of)) -> Any:
    return await answer(request, "completion", tenant)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request, tenant: Tenant = Depends(tenant_of)) -> Any:
    return await answer(request, "chat", tenant)


async def answer(request: Request, endpoint: Endpoint, tenant: Tenant) -> Any:
    gw = gateway_of(request)
    started = time.perf_counter()
    gw.metrics.in_progress.labels(endpoint).inc()
    status, streaming = 500, False
    try:
        req, jobs, queue, timeout = await _checked(request, gw, endpoint, tenant)
        job_ids = [job.id for job in jobs]
        # NOTE: a request holds one place of its tenant's, however many prompts it carries (their
        # number is bounded by MAX_PROMPTS)
        counted = await gw.outstanding.acquire(tenant, job_ids[0])
        try:
            await _submit(gw, jobs, queue)
            if not req.stream:
                response = await _wait(request, gw, req, job_ids, timeout)
            else:
                run = StreamRun(gw, req, job_ids, tenant if counted else None, started, timeout)
                if await run.start(request):
                    streaming = True  # the stream gives its place back and counts itself when it ends
                    response = StreamingResponse(run.events(), media_type="text/event-stream", headers=SSE_HEADERS)
                else:  # the client left before the first token: its job is cancelled
                    gw.metrics.cancelled.labels(endpoint).inc()
                    response = Response(status_code=CLIENT_CLOSED)
        finally:
            if counted and not streaming:
                await gw.outstanding.release(tenant, job_ids[0])
        status = response.status_code
        return response
    except APIError as exc:
        status = exc.status
        raise
    finally:
        if not streaming:
            gw.metrics.in_progress.labels(endpoint).dec()
            gw.metrics.requests.labels(endpoint, str(status)).inc()
            gw.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)


async def _checked(request: Request, gw: Gateway, endpoint: Endpoint,
                   tenant: Tenant) -> tuple[OpenAIRequest, list[Job], str, float]:
    """The request's jobs (one per prompt), their queue and its time limit; 400 / 404 / 429 / 503 otherwise."""
    body = await json_body(request)
    timeout = _header_timeout(request, gw.settings.request_timeout)
    # NOTE: the job's deadline is the request's (and a second): workers expire a job whose
    # gateway died before it could cancel it, and the gateway's own 504 comes first otherwise
    req = translate_request(endpoint, body, tenant=tenant.name, tier=_header_tier(request),
                            priority=_header_priority(request), deadline=time.time() + timeout + DEADLINE_SLACK_S,
                            tool_parsers=gw.tool_parsers)
    model = await gw.models.serving(req.model)
    jobs = req.to_jobs()
    queue = model.queue(req.tier)
    model.check_speaks(jobs, queue)
    await gw.check_backlog(queue)
    return req, jobs, queue, timeout


async def _submit(gw: Gateway, jobs: list[Job], queue: str) -> None:
    """Enqueue the request's jobs together; a submit that fails halfway cancels what it enqueued."""
    try:
        if len(jobs) == 1:
            await gw.client.submit_job(jobs[0], queue)
        else:
            await gw.client.submit_jobs(jobs, queue)
    except BaseException:
        if len(jobs) > 1:
            cancel_jobs(gw, [job.id for job in jobs])
        raise


def _header_tier(request: Request) -> str | None:
    tier = request.headers.get(QUEUE_HEADER)
    if tier is not None and tier not in ("interactive", "bulk"):
        raise invalid_value(QUEUE_HEADER, tier, "must be interactive or bulk")
    return tier


def _header_priority(request: Request) -> int | None:
    value = request.headers.get(PRIORITY_HEADER)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise invalid_value(PRIORITY_HEADER, value, "must be an integer") from None


def _header_timeout(request: Request, limit: float) -> float:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return limit
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise invalid_value(TIMEOUT_HEADER, value, "must be a number of seconds > 0")
    return min(seconds, limit)


async def _wait(request: Request, gw: Gateway, req: OpenAIRequest, job_ids: list[str],
                timeout: float) -> JSONResponse:
    """The jobs' results as the response; they are cancelled if the client leaves first, or one fails."""
    # NOTE: one Redis connection waits for the request however many prompts it has (an eval
    # harness's 256 each, and a pool of --redis-max-connections); a job that fails is seen within
    # RESULTS_WATCH_S and fails the request, one that times out at once
    result = asyncio.ensure_future(gw.client.results(job_ids, timeout=timeout))
    left = asyncio.ensure_future(client_left(request))
    try:
        await asyncio.wait((result, left), return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not result.done():
            result.cancel()
    # NOTE: the cancels run beside the response: one may ride a Redis outage for the client's
    # window, and the 504 (or the closed connection's bookkeeping) does not wait for it
    if not result.done() or result.cancelled():
        cancel_jobs(gw, job_ids)
        gw.metrics.cancelled.labels(req.endpoint).inc()
        return JSONResponse({}, status_code=CLIENT_CLOSED)
    try:
        done = result.result()
    except Timeout:
        cancel_jobs(gw, job_ids)
        raise timeout_error(timeout) from None
    except (JobError, JobNotFound) as exc:
        if len(job_ids) > 1:
            cancel_jobs(gw, job_ids)  # NOTE: the failed one has ended; cancelling it changes nothing
        raise job_error(exc, req.endpoint) from None
    response = translate_results(done)
    gw.metrics.tokens.labels(req.endpoint).inc(sum(r.usage.completion_tokens for r in done))
    return JSONResponse(response)


