"""The Batch API's share of one gateway process: its store, its file removal, its feeder, and
how a batch line becomes a job (the gateway's own ``translate``, so a batch line is checked as
the same request sent to ``/v1/chat/completions`` would be)."""

from __future__ import annotations

import functools
from typing import Any

from fastapi import Request

from gateway.batch_feeder import Feeder
from gateway.batch_settings import BatchSettings
from gateway.batch_store import Store
from gateway.file_removal import FileRemoval
from gateway.model_parsers import NO_PARSERS, ModelParsers
from gateway.models import ModelDirectory
from gateway.shutdown import bounded
from gateway.translate import translate_line, translate_results
from producers.connection import connect_async
from producers.protocol import Job


class BatchService:
    """Files and batches of one gateway process; ``start`` / ``close`` with the app."""

    def __init__(self, redis_url: str, prefix: str, models: ModelDirectory, settings: BatchSettings | None = None,
                 queue_shards: int = 0, *, tool_parsers: ModelParsers = NO_PARSERS, **redis_kwargs: Any) -> None:
        self.settings = settings or BatchSettings()
        self.redis = connect_async(redis_url, decode_responses=True, **redis_kwargs)
        self.raw = connect_async(redis_url, decode_responses=False, **redis_kwargs)
        self.models = models
        self.store = Store(self.redis, self.raw, prefix, self.settings, queue_shards)
        self.removal = FileRemoval(self.store)
        # NOTE: a line's auto tool choice is read by the gateway's --tool-call-parser for the line's model
        translate = functools.partial(translate_line, tool_parsers=tool_parsers)
        self.feeder = Feeder(self.store, self.removal, self.settings, translate, translate_results, self.queue_of,
                             self.unspoken_of)

    async def queue_of(self, model: str | None) -> str | None:
        """The bulk queue of ``model`` when a worker advertised it (live, or the latest record of
        one that died); None for a name no worker advertised while others did (the line is
        answered ``model_not_found``, as a chat request would be); the configured queue while no
        worker has advertised any.

        NOTE: a batch whose model has no live worker now waits on its queue rather than fails:
        a batch runs within its completion window, not at once."""
        models = await self.models.models()
        served = models.get(model or "")
        if served is None:
            return None if models else self.settings.queue
        return served.queue("bulk") if served.queues or served.last_queues else self.settings.queue

    async def unspoken_of(self, model: str | None, queue: str, jobs: list[Job]) -> tuple[str, str] | None:
        """The body's field and why, when a line's ``jobs`` need a later protocol revision than a live
        worker of ``queue`` (``model``'s, ``queue_of``) speaks (``ServedModel.unspoken``: the endpoint's
        400); None otherwise."""
        served = (await self.models.models()).get(model or "")
        return served.unspoken(jobs, queue) if served is not None else None

    async def start(self) -> None:
        await self.feeder.start()

    async def close(self) -> None:
        await self.feeder.stop()
        for client in (self.redis, self.raw):  # NOTE: bounded: a hung connection does not keep the gateway up
            await bounded(client.aclose(), "closing a batch connection")


def batches_of(request: Request) -> BatchService:
    return request.app.state.batches
