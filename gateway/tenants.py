"""API keys and tenants: who a request is, and how many of its requests may be unanswered.

Each API key is one tenant. Its jobs carry the tenant in their ``metadata`` (``tenant``), and
its unanswered requests are counted in one Redis sorted set per tenant, so the limit holds
over every gateway process; each entry lapses at its request's deadline, so a gateway that
dies leaks nothing for longer than that.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from fastapi import Request

from gateway.errors import APIError
from gateway.settings import DEFAULT_TENANT, GatewaySettings

LAPSE_SLACK_S = 30.0  # an entry outlives its request's timeout by this much, then stops counting


@dataclass(frozen=True)
class Tenant:
    name: str


class Authenticator:
    """``Authorization: Bearer KEY`` (or ``api-key: KEY``) -> its tenant; 401 otherwise."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.tenants = settings.tenants

    def __call__(self, request: Request) -> Tenant:
        if not self.tenants:
            return Tenant(DEFAULT_TENANT)
        given = _presented_key(request)
        if given is None:
            raise APIError(401, "missing API key: send it as 'Authorization: Bearer KEY'", code="missing_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        for key, tenant in self.tenants.items():
            if hmac.compare_digest(key.encode(), given.encode()):
                return Tenant(tenant)
        raise APIError(401, "incorrect API key provided", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def _presented_key(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header:
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return request.headers.get("api-key") or None


class OutstandingLimit:
    """At most ``limit`` unanswered requests per tenant, over every gateway on this Redis."""

    def __init__(self, redis: aioredis.Redis, settings: GatewaySettings) -> None:
        self.redis = redis
        self.keys = settings.keys
        self.settings = settings
        self.lapse_s = settings.request_timeout + LAPSE_SLACK_S

    async def acquire(self, tenant: Tenant, job_id: str) -> bool:
        """Count ``job_id`` for ``tenant``; 429 (nothing counted) when that passes the limit.
        Returns whether anything was counted (so ``release`` is due)."""
        limit = self.settings.outstanding_limit(tenant.name)
        if limit is None:
            return False
        key, now = self.keys.outstanding(tenant.name), time.time()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(key, "-inf", now)
            pipe.zadd(key, {job_id: now + self.lapse_s})
            pipe.zcard(key)
            pipe.expire(key, int(self.lapse_s) + 1)
            _, _, count, _ = await pipe.execute()
        if count > limit:
            # NOTE: add, then count, then take back: two requests racing for the last place may
            # both be refused, never both admitted.
            await self.redis.zrem(key, job_id)
            raise APIError(429, f"tenant {tenant.name} has {limit} requests unanswered already, its limit"
                                " (max_outstanding); wait for one to finish", code="too_many_outstanding_requests",
                           headers={"Retry-After": "1"})
        return True

    async def release(self, tenant: Tenant, job_id: str) -> None:
        await self.redis.zrem(self.keys.outstanding(tenant.name), job_id)
