"""The models the gateway serves: read from the workers' heartbeats (``{prefix}:workers``).

Each worker advertises ``served_model_name`` and its ``queues`` (highest priority first). A
model is served while one worker of it is live (its heartbeat fresh, not draining); a model
whose every worker died is known but unavailable (503); a name no worker ever advertised
is unknown (404). The records are cached ``models_refresh_seconds``, so a burst of requests
costs one read, and are read as the clients read them (``producers.heartbeats``). A request whose
job needs a later protocol revision than a live worker of its queue speaks is a 400
(``ServedModel.check_speaks``), not a job that worker refuses; the gateway's only revision check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from gateway.errors import APIError, InvalidRequest
from producers.heartbeats import read_fleet
from producers.openai_format import UNSPOKEN, result_reads, revision_param
from producers.protocol import PROTOCOL_REVISION, Job, Keys, job_needs
from producers.protocol.revisions import Spoken, revision_key, unmet, unmet_message

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """One model name and the workers that advertise it."""

    name: str
    queues: list[str] = field(default_factory=list)  # of its live workers, in the first one's order
    # of its latest record while none is live (a worker that died keeps its record): where its
    # batch lines wait for the next one
    last_queues: list[str] = field(default_factory=list)
    last_seen: float = float("-inf")
    live: int = 0  # workers serving it now
    created: int = 0  # when its oldest live worker started (unix seconds)
    shared_with: list[str] = field(default_factory=list)  # other live models that read one of its queues
    # each of its queues that has a live worker -> the revisions the queue's live workers speak
    spoken: dict[str, Spoken] = field(default_factory=dict)

    def queue(self, tier: str) -> str:
        """The queue of a tier: ``interactive`` -> the workers' first queue, ``bulk`` -> their last.

        NOTE: a worker reads its queues in order, the first above the rest, so the first is the
        model's interactive queue and the last its bulk one, whatever the operator named them.
        """
        queues = self.queues or self.last_queues
        return queues[-1] if tier == "bulk" else queues[0]

    def unspoken(self, jobs: Iterable[Job], queue: str) -> tuple[str, str] | None:
        """The request field and why, when one of a request's ``jobs`` needs a later protocol
        revision than a live worker of ``queue`` speaks (``producers.protocol.revisions.unmet``:
        any of them may take it); None otherwise, and while the queue has no live worker (the job
        waits there for the workers that come later, as any does)."""
        spoken = self.spoken.get(queue)
        if spoken is None or revision_key(spoken.oldest) >= revision_key(PROTOCOL_REVISION):
            return None  # NOTE: the hot path: a fleet of this release runs every job this gateway makes
        for job in jobs:
            need = job_needs(job, result_reads(job))
            if unmet(need, spoken):
                return revision_param(need.field), unmet_message(
                    need, spoken, f"live workers of model {self.name!r}'s queue {queue!r}")
        return None

    def check_speaks(self, jobs: Iterable[Job], queue: str) -> None:
        """400 naming the field when a job needs a revision a live worker of ``queue`` does not speak
        (``unspoken``)."""
        found = self.unspoken(jobs, queue)
        if found is not None:
            param, reason = found
            raise InvalidRequest(param, f"{param}: {reason}", code=UNSPOKEN)


class ModelDirectory:
    """Served models from the heartbeats, re-read at most every ``refresh_s`` seconds."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, refresh_s: float, *, named: Iterable[str] = ()) -> None:
        self.redis = redis
        self.keys = keys
        self.refresh_s = refresh_s
        # models the operator named (--tool-call-parser MODEL=PARSER) that no worker record has
        # named yet: each is logged once, at the first read that still lacks it (a misspelt name
        # would otherwise quietly give that model the default parser)
        self._unseen = set(named)
        self._models: dict[str, ServedModel] = {}
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()

    async def models(self) -> dict[str, ServedModel]:
        """Every model any worker record names (live or not), by name."""
        if time.monotonic() - self._read_at > self.refresh_s:
            async with self._lock:  # one read for every waiter
                if time.monotonic() - self._read_at > self.refresh_s:
                    self._models = self._from_records(await self.redis.hgetall(self.keys.workers))
                    self._read_at = time.monotonic()
                    self._warn_unseen()
        return self._models

    async def serving(self, name: str) -> ServedModel:
        """The live model ``name``; 404 if no worker ever named it, 503 if none serves it now."""
        model = (await self.models()).get(name)
        if model is None:
            raise APIError(404, f"model {name!r} does not exist: no worker serves it (GET /v1/models lists the"
                                f" models served now)", param="model", code="model_not_found")
        if not model.live:
            raise APIError(503, f"model {name!r} has no live worker right now; try again later", param="model",
                           code="model_unavailable", headers={"Retry-After": "5"})
        if model.shared_with:
            # NOTE: a job on a queue two models read would run on either: refused, never misrouted
            raise APIError(503, f"model {name!r} shares its queues {model.queues} with {model.shared_with}; give each"
                                " model's workers queues of their own (--queues)", param="model",
                           code="model_misconfigured")
        return model

    def _warn_unseen(self) -> None:
        if not self._unseen or not self._models:  # NOTE: no record at all: no fleet to tell a misspelling by
            return
        for name in sorted(self._unseen - self._models.keys()):
            log.warning("gateway.tool_parser_model_unknown model=%s served=%s (--tool-call-parser %s=...: no worker"
                        " record names a model so; its requests would take the default parser)",
                        name, ",".join(sorted(self._models)), name)
        self._unseen.clear()

    def _from_records(self, records: dict[str, str]) -> dict[str, ServedModel]:
        fleet = read_fleet(records)
        for name in fleet.unreadable:
            log.warning("gateway.bad_worker_record worker=%s", name)
        found: dict[str, ServedModel] = {}
        readers: dict[tuple[str, ...], set[str]] = {}  # the queues of a live worker -> its models
        for worker in fleet.workers:
            info = worker.info
            model_name = info.served_model_name or info.model
            model = found.setdefault(model_name, ServedModel(model_name))
            if info.queues and info.last_seen > model.last_seen:
                model.last_queues, model.last_seen = list(info.queues), info.last_seen
            if worker.live and info.queues:
                if not model.live:
                    model.queues = list(info.queues)
                    model.created = int(info.started_at)
                model.live += 1
                model.created = min(model.created, int(info.started_at))
                readers.setdefault(tuple(info.queues), set()).add(model_name)
        spoken = fleet.spoken()
        for model in found.values():
            model.spoken = {queue: spoken[queue] for queue in model.queues if queue in spoken}
            model.shared_with = sorted({other for queues, names in readers.items() if set(queues) & set(model.queues)
                                        for other in names} - {model.name}) if model.live else []
        return found
