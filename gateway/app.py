"""``create_app(settings)``: the gateway's FastAPI application.

One ``Gateway`` per process (``app.state.gateway``, ``gateway/state.py``) holds the Redis
client, the model directory, the authenticator, the tenant limit and the metrics; routes
reach it through ``gateway_of(request)`` and the tenant through the ``tenant_of``
dependency. A new router is one more entry of ``ROUTERS``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gateway import batches, completions, files, model_routes
from gateway.batch_service import BatchService
from gateway.batch_settings import BatchSettings
from gateway.errors import APIError, install_error_handlers
from gateway.settings import GatewaySettings
from gateway.state import Gateway, gateway_of

log = logging.getLogger("sluiceway.gateway")

meta_router = APIRouter()


@meta_router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while Redis answers; 503 otherwise (the gateway itself keeps no other state)."""
    try:
        await gateway_of(request).client.redis.ping()
    except Exception as exc:  # any failure to reach Redis is "unhealthy", whatever its type
        raise APIError(503, f"redis unreachable: {type(exc).__name__}: {exc}", code="redis_unavailable") from None
    return JSONResponse({"status": "ok"})


@meta_router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(gateway_of(request).metrics.render(), media_type="text/plain; version=0.0.4")


ROUTERS: tuple[APIRouter, ...] = (meta_router, model_routes.router, completions.router, files.router, batches.router)


def create_app(settings: GatewaySettings, batch_settings: BatchSettings | None = None) -> FastAPI:
    """The gateway's app over ``settings.redis`` (which must be set: the CLI starts a private one);
    ``batch_settings`` (default: from ``SLUICEWAY_BATCH_*``) are the Batch API's limits."""
    if not settings.redis:
        raise ValueError("redis: a URL is needed to build the app (sluiceway serve starts a private server)")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await app.state.batches.start()
        yield
        # NOTE: each part of the shutdown says it is done, so a stop that hangs says where
        await app.state.batches.close()
        log.info("shutdown: the batch feeder stopped and its connections closed")
        await app.state.gateway.close()
        log.info("shutdown: the gateway's client closed")

    app = FastAPI(title="Sluiceway", description="OpenAI-compatible API over the Sluiceway queues",
                  lifespan=lifespan)
    app.state.gateway = Gateway(settings)
    app.state.batches = BatchService(settings.redis, settings.prefix, app.state.gateway.models, batch_settings,
                                     settings.queue_shards, tool_parsers=app.state.gateway.tool_parsers)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app


def create_app_from_environment() -> FastAPI:
    """``create_app`` over settings read from ``SLUICEWAY_*`` alone: each of ``--workers`` processes calls it."""
    return create_app(GatewaySettings())
