"""The worker's start checks: a server and key layout it can run on, and a name no live worker
holds. Run once at start; when Redis is away then, by a thread of their own once it answers.

Until they pass, the components that read jobs or write the worker's record wait on
``passed`` (their ``gate``): two consumers of one name would share their pending entries, and
the second one's heartbeat would overwrite the first one's record.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from producers.connection import UnsupportedServer, check_layout, check_server
from worker.component import Component, is_transient
from worker.heartbeat import Heartbeat, NameInUse
from worker.logs import event
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

RETRY_S = 1.0  # how often a worker started without Redis tries its checks


class StartChecks(Component):
    """The checks, and (started) their retries until they pass or refuse the worker."""

    name = "start-checks"

    def __init__(self, client: redis.Redis, settings: WorkerSettings, heartbeat: Heartbeat,
                 on_refused: Callable[[], None]) -> None:
        super().__init__(RETRY_S)
        self.client = client
        self.settings = settings
        self.heartbeat = heartbeat
        self.on_refused = on_refused
        self.passed = threading.Event()
        self.refusal: str | None = None  # why a retry refused the worker

    def run(self) -> None:
        """One clear refusal (``NameInUse``, ``UnsupportedServer``), not MOVED or CROSSSLOT at
        every turn or two consumers sharing their pending entries; a Redis error as it comes."""
        s = self.settings
        check_server(self.client, s.queue_shards)
        check_layout(self.client, s.prefix, s.keys.layout, s.queue_shards)
        self.heartbeat.check_name_free()
        self.passed.set()

    def tick(self) -> None:
        if self.passed.is_set():  # passed at start: nothing to retry
            self._stop.set()
            return
        try:
            self.run()
        except Exception as exc:
            if is_transient(exc):  # away again, loading, a failover: the component's backoff, then again
                raise
            # NOTE: what would have ended the start (a name held, a server it cannot run on, an
            # ACL refusing the checks' commands) ends the worker, which has read nothing yet
            known = isinstance(exc, (NameInUse, UnsupportedServer))
            self.refusal = str(exc) if known else f"{type(exc).__name__}: {exc}"
            event(log, "worker.refused", logging.CRITICAL, error=self.refusal)
            self._stop.set()
            self.on_refused()
            return
        event(log, "worker.start_checks_passed")
        self._stop.set()
