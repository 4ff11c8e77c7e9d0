"""``Gateway``: what every request of one gateway process shares, and how routes reach it."""

from __future__ import annotations

import asyncio

from fastapi import Request

from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.models import ModelDirectory
from gateway.settings import GatewaySettings
from gateway.shutdown import bounded
from gateway.tenants import Authenticator, OutstandingLimit, Tenant
from producers.aio import AsyncClient

# NOTE: one connection per blocked wait on a done signal (a whole response): the pool grows
# with the requests in flight, up to --redis-max-connections. Token streams are all read by
# one task on one connection (producers/aio_streams.py): per-stream reads were most of a
# gateway's time, one Redis round trip (and reply) per token entry of every stream.
REDIS_SOCKET_TIMEOUT_S = 120.0


class Gateway:
    """What every request of one process shares."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        # NOTE: check_revisions off: a request's protocol revision is checked once, by the model
        # directory's read of the heartbeats (ServedModel.check_speaks), never by a second read that
        # may see another fleet
        self.client = AsyncClient(settings.redis, prefix=settings.prefix, queue_shards=settings.queue_shards,
                                  shared_streams=True, check_revisions=False, socket_timeout=REDIS_SOCKET_TIMEOUT_S,
                                  health_check_interval=30, max_connections=settings.redis_max_connections)
        self.keys = self.client.keys
        self.tool_parsers = settings.auto_tool_parsers  # each model's parser of an auto tool choice
        self.models = ModelDirectory(self.client.redis, self.keys, settings.models_refresh_seconds,
                                     named=self.tool_parsers.by_model)
        self.authenticate = Authenticator(settings)
        self.outstanding = OutstandingLimit(self.client.redis, settings)
        self.metrics = GatewayMetrics()

    async def check_backlog(self, queue: str) -> None:
        """429 when ``queue`` holds more jobs than ``--max-backlog``."""
        limit = self.settings.max_backlog
        if limit is None:
            return
        # NOTE: the sum of the queue's shard streams (one stream in the single-node layout)
        backlog = sum(await asyncio.gather(*(self.client.redis.xlen(s) for s in self.keys.queue_streams(queue))))
        if backlog > limit:
            raise APIError(429, f"queue {queue!r} holds {backlog:,} jobs, more than this gateway's limit of"
                                f" {limit:,} (max_backlog); try again later", code="backlog_full",
                           headers={"Retry-After": "1"})

    async def close(self) -> None:
        await bounded(self.client.close(), "closing the gateway's Redis client")  # NOTE: as the feeder's stop


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


def tenant_of(request: Request) -> Tenant:
    """The request's tenant (a route dependency); 401 without a valid key."""
    return gateway_of(request).authenticate(request)
