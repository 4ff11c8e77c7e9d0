"""What Celery's tools see of the GPU worker: replies on the control mailbox, and task events.

The node ``sluiceway@<worker name>`` answers ``celery inspect`` / ``app.control``:
``ping``, ``active`` (tasks in the engine or waiting in admission), ``scheduled`` (tasks
waiting for their eta), ``reserved`` (always empty: nothing is read ahead of admission),
``stats``, ``active_queues``, ``registered`` (its one task name), ``revoked`` (the ids it was
told to revoke), ``revoke``, ``enable_events`` / ``disable_events``; any other command gets
kombu's ``{"error": ...}`` reply.

Task events (``task-received``, ``-started``, ``-succeeded``, ``-failed``, ``-revoked``) and
worker heartbeats (``worker-online``, ``-heartbeat``, ``-offline``) go out on Celery's event
exchange when ``worker_send_task_events`` is set in ``--celery-config`` or a monitor such as
Flower sends ``enable_events``. Everything here runs on the ingress thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any

from producers.celery_app import TASK_NAME
from worker.celery_tasks import CeleryTask
from worker.logs import event

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # Celery's worker heartbeat frequency
REVOKED_LISTED = 10_000  # the revoked ids ``inspect revoked`` lists, latest kept


def task_info(task: CeleryTask, started_at: float | None, hostname: str) -> dict:
    """A task as ``inspect active`` shows it (the fields of Celery's ``Request.info``)."""
    request = task.request
    return {"id": task.task_id, "name": TASK_NAME, "type": TASK_NAME, "args": request.get("args"),
            "kwargs": request.get("kwargs"), "hostname": hostname, "time_start": started_at,
            "acknowledged": False, "delivery_info": request.get("delivery_info"), "worker_pid": os.getpid()}


class CeleryControl:
    """Control replies and events of the node; the ingress hands it its state."""

    def __init__(self, ingress: Any) -> None:
        self.ingress = ingress
        self.started = time.time()
        self.processed = 0
        self.events_enabled = bool(ingress.app.conf.worker_send_task_events)
        self._dispatcher = None
        self._next_heartbeat = 0.0
        self.handlers = {"ping": self.ping, "active": self.active, "scheduled": self.scheduled,
                         "reserved": lambda state, **_: [], "stats": self.stats, "active_queues": self.active_queues,
                         "revoke": self.revoke, "enable_events": self.enable_events,
                         "disable_events": self.disable_events, "registered": self.registered,
                         "revoked": self.revoked}
        # the ids this node was told to revoke, latest last (Celery's worker keeps such a list too)
        self._revoked_ids: OrderedDict[str, None] = OrderedDict()

    # --- replies: handler(state, **arguments), as kombu's Node calls them ------------------------
    def ping(self, state: Any, **_: Any) -> dict:
        return {"ok": "pong"}

    def active(self, state: Any, **_: Any) -> list[dict]:
        name = self.ingress.node_name
        return [task_info(d.task, d.started_at, name) for d in self.ingress.results.deliveries()]

    def scheduled(self, state: Any, **_: Any) -> list[dict]:
        name = self.ingress.node_name
        return [{"eta": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(eta)),
                 "priority": (task.request.get("delivery_info") or {}).get("priority"),
                 "request": task_info(task, None, name)} for eta, _, _, task in sorted(self.ingress._waiting)]

    def stats(self, state: Any, **_: Any) -> dict:
        ingress = self.ingress
        return {"pid": os.getpid(), "uptime": int(time.time() - self.started), "total": {TASK_NAME: self.processed},
                "prefetch_count": ingress.prefetch, "clock": str(ingress.app.clock.value),
                "pool": {"implementation": "sluiceway", "max-concurrency": ingress.prefetch,
                         "processes": [os.getpid()]},
                "broker": {"transport": "redis", "hostname": ingress.app.conf.broker_url and "redis"},
                "sw_ident": "sluiceway-worker"}

    def active_queues(self, state: Any, **_: Any) -> list[dict]:
        queue = self.ingress.celery_queue
        return [{"name": queue, "exchange": {"name": queue, "type": "direct"}, "routing_key": queue,
                 "durable": True, "exclusive": False, "auto_delete": False, "no_ack": False}]

    def registered(self, state: Any, **_: Any) -> list[str]:
        """The one task name this node runs (Flower's worker page asks for it)."""
        return [TASK_NAME]

    def revoked(self, state: Any, **_: Any) -> list[str]:
        return list(self._revoked_ids)

    def revoke(self, state: Any, task_id: Any = None, **_: Any) -> dict:
        ids = [task_id] if isinstance(task_id, str) else list(task_id or [])
        for one in ids:
            self.ingress.revoke(str(one))
            self._revoked_ids[str(one)] = None
            self._revoked_ids.move_to_end(str(one))
            while len(self._revoked_ids) > REVOKED_LISTED:
                self._revoked_ids.popitem(last=False)
        return {"ok": f"tasks {', '.join(map(str, ids))} flagged as revoked"}

    def enable_events(self, state: Any, **_: Any) -> dict:
        self.events_enabled = True
        return {"ok": "task events enabled"}

    def disable_events(self, state: Any, **_: Any) -> dict:
        self.events_enabled = False
        return {"ok": "task events disabled"}

    # --- events ------------------------------------------------------------------------------------
    def send(self, kind: str, task: CeleryTask | None = None, **fields: Any) -> None:
        """Send event ``kind`` (``task-...`` of ``task``, or ``worker-...``) when events are on."""
        if kind in ("task-succeeded", "task-failed", "task-revoked"):
            self.processed += kind != "task-revoked"
        if not self.events_enabled:
            return
        if task is not None:
            fields["uuid"] = task.task_id
        try:
            if self._dispatcher is None:
                self._dispatcher = self.ingress.app.events.Dispatcher(
                    self.ingress.app.connection_for_write(), hostname=self.ingress.node_name, enabled=True)
            self._dispatcher.send(kind, **fields)
        except Exception as exc:  # NOTE: monitoring must never stop tasks; the next event reconnects
            event(log, "celery.event_unsent", logging.WARNING, kind=kind, error=repr(exc))
            self.close()

    def heartbeat(self) -> None:
        now = time.monotonic()
        if not self.events_enabled or now < self._next_heartbeat:
            return
        kind = "worker-online" if self._next_heartbeat == 0.0 else "worker-heartbeat"
        self._next_heartbeat = now + HEARTBEAT_S
        self.send(kind, freq=HEARTBEAT_S, active=len(self.ingress.results), processed=self.processed,
                  loadavg=list(os.getloadavg()), sw_ident="sluiceway-worker", sw_ver="1", sw_sys=os.uname().sysname)

    def close(self, offline: bool = False) -> None:
        if offline and self.events_enabled and self._dispatcher is not None:
            try:
                self._dispatcher.send("worker-offline")
            except Exception:
                pass
        dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None:
            try:
                dispatcher.close()
                dispatcher.connection.release()
            except Exception:
                pass
