"""The worker's Celery parts, built from its settings: the ingress and a client on its broker.

Celery is an optional extra: without it the ingress is None and the worker runs the Redis
queues alone (``celery.unavailable``, said once). With it, a broker or backend URL it cannot
use is a ValueError that names the settings, not that warning.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

import redis

from producers.connection import broker_redis_url, celery_target, connect, redacted
from worker.admission import Admission, Held
from worker.logs import event
from worker.metrics import Metrics
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from worker.celery_ingress import CeleryIngress

log = logging.getLogger(__name__)


def celery_ingress(s: WorkerSettings, url: str, admission: Admission, held: Held,
                   metrics: Metrics) -> CeleryIngress | None:
    """The Celery ingress on the worker's own Redis ``url`` (or ``--celery-broker``); None without celery."""
    # NOTE: --celery-broker / --celery-backend take Celery's own URLs as they are, and any URL
    # ``connect`` takes (redis+sentinel:// too), spelled for Celery here.
    broker = celery_target(s.celery_broker or url)
    backend = celery_target(s.celery_backend) if s.celery_backend else None
    try:
        from worker.celery_ingress import CeleryIngress

        return CeleryIngress(broker.url, backend.url if backend else None, admission, held,
                             s.name, celery_queue=s.celery_queue, metrics=metrics,
                             config=s.celery_config, result_ttl=s.result_ttl,
                             claim_idle_s=s.claim_idle_seconds, broker_options=broker.transport_options,
                             backend_options=backend.transport_options if backend else None)
    except ImportError as exc:  # NOTE: celery is an optional extra; the Redis queues work without it
        if importlib.util.find_spec("celery") is not None:  # installed: a URL names a transport it lacks
            urls = ", ".join(redacted(u) for u in (broker.url, backend.url if backend else None) if u)
            raise ValueError(f"celery_broker / celery_backend: Celery cannot use {urls}: {exc}") from None
        event(log, "celery.unavailable", logging.WARNING, queue=s.celery_queue, error=str(exc),
              hint="Celery tasks are not consumed: pip install 'sluiceway[celery]', or --no-celery to silence this")
        return None


def broker_client(s: WorkerSettings, own: redis.Redis) -> redis.Redis | None:
    """A redis-py client on the Celery broker, to read its queue depth: ``own`` unless overridden."""
    if s.celery_broker is None:
        return own
    try:
        return connect(broker_redis_url(s.celery_broker), socket_timeout=10, socket_connect_timeout=5)
    except ValueError as exc:  # a broker URL redis-py cannot open (sentinel://): no depth, still consumed
        event(log, "celery.depth_unread", logging.WARNING, broker_scheme=s.celery_broker.split("://")[0],
              error=str(exc))
        return None
