"""What Celery's tools see of the GPU worker: replies on the control mailbox, and task events.

The node ``sluiceway@<worker name>`` answers ``celery inspect`` / ``app.control``:
``ping``, ``active`` (tasks in the engine or waiting in admission), ``scheduled`` (tasks
waiting for their eta), ``reserved`` (always empty: nothing is read ahead of admission),
``query_task`` (the given ids among those), ``stats``, ``active_queues``, ``registered`` (its
one task name), ``revoked`` (the ids it was told to revoke), ``conf`` (its Celery app's
settings, secrets masked), ``report``, ``revoke``, ``enable_events`` / ``disable_events``; any
other command gets kombu's ``{"error": ...}`` reply.

Task events (``task-received``, ``-started``, ``-succeeded``, ``-failed``, ``-revoked``) and
worker heartbeats (``worker-online``, ``-heartbeat``, ``-offline``) go out on Celery's event
exchange when ``worker_send_task_events`` is set in ``--celery-config`` or a monitor such as
Flower sends ``enable_events``. Everything here runs on the ingress thread.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import time
from collections import OrderedDict
from typing import Any

from producers.celery_app import TASK_NAME
from worker.celery_tasks import CeleryTask
from worker.logs import event

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # Celery's worker heartbeat frequency
REVOKED_LISTED = 10_000  # the revoked ids ``inspect revoked`` lists, latest kept
MASK = "*" * 8  # what Celery's worker shows in place of a secret
# Celery's HIDDEN_SETTINGS (celery/app/utils.py): a setting, nested key or URL query parameter so named is masked
SECRET_NAME = re.compile("API|TOKEN|KEY|SECRET|PASS|PROFANITIES_LIST|SIGNATURE|DATABASE|BEAT_DBURI", re.IGNORECASE)


def task_info(task: CeleryTask, started_at: float | None, hostname: str) -> dict:
    """A task as ``inspect active`` shows it (the fields of Celery's ``Request.info``)."""
    request = task.request
    return {"id": task.task_id, "name": TASK_NAME, "type": TASK_NAME, "args": request.get("args"),
            "kwargs": request.get("kwargs"), "hostname": hostname, "time_start": started_at,
            "acknowledged": False, "delivery_info": request.get("delivery_info"), "worker_pid": os.getpid()}


def censored(value: Any, name: Any = None) -> Any:
    """Settings as ``inspect conf`` may show them: a value whose name looks secret (``SECRET_NAME``)
    masked whole, and in every string the password and secret-named query values of each URL
    (kombu's ``;``-joined lists too). Celery's own filter masks URLs only in settings it knows to
    hold one, leaves a password given in a backend URL's query, and fails on a broker URL with a
    password both before the host and in the query."""
    if isinstance(value, dict):
        return {key: censored(item, key) for key, item in value.items()}
    if isinstance(name, str) and SECRET_NAME.search(name):
        return MASK
    if isinstance(value, list):
        return [censored(item, name) for item in value]
    if isinstance(value, str) and "://" in value:
        return ";".join(_masked_url(part) for part in value.split(";"))
    return value


def _masked_url(url: str) -> str:
    head, question, query = url.partition("?")
    scheme, sep, rest = head.partition("://")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{hosts}"
    params = (param.partition("=") for param in query.split("&")) if query else ()
    query = "&".join(f"{k}{eq}{MASK if eq and SECRET_NAME.search(k) else v}" for k, eq, v in params)
    return f"{scheme}{sep}{netloc}{slash}{path}{question}{query}"


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
                         "revoked": self.revoked, "query_task": self.query_task, "conf": self.conf,
                         "report": self.report}
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

    def query_task(self, state: Any, ids: Any = None, **_: Any) -> dict[str, tuple[str, dict]]:
        """``{id: [state, info]}`` for each given id this node holds, as Celery's worker answers:
        ``active`` (in the engine or waiting in admission, as ``inspect active`` lists it) or
        ``scheduled`` (waiting for its eta); an id it does not hold (unknown, ended) is left out."""
        wanted = {ids} if isinstance(ids, str) else set(map(str, ids or ()))
        name = self.ingress.node_name
        found = {task.task_id: ("scheduled", task_info(task, None, name))
                 for _, _, _, task in self.ingress._waiting if task.task_id in wanted}
        for delivery in self.ingress.results.deliveries():
            if delivery.task.task_id in wanted:
                found[delivery.task.task_id] = ("active", task_info(delivery.task, delivery.started_at, name))
        return found

    def conf(self, state: Any, with_defaults: bool = False, **_: Any) -> dict:
        """The Celery app's settings, as Celery's worker lists them: those not at their default
        (every one with ``with_defaults``), JSON-able, secrets masked (``censored``)."""
        from celery.utils.serialization import jsonify
        from kombu.utils.encoding import safe_repr

        table = self.ingress.app.conf.table(with_defaults=bool(with_defaults), censored=False)
        return censored(jsonify(table, keyfilter=lambda key: isinstance(key, str) and not key.startswith("__"),
                                unknown_type_filter=safe_repr))

    def report(self, state: Any, **_: Any) -> dict:
        """A short text for a bug report, as Celery's worker gives (``{"ok": text}``): versions,
        platform, this node's tasks and its settings (as ``conf`` shows them)."""
        import celery
        import kombu
        import redis

        ingress = self.ingress
        settings = self.conf(state)
        lines = [f"node     -> {ingress.node_name} pid:{os.getpid()} uptime:{int(time.time() - self.started)}s"
                 f" active:{len(ingress.results)} scheduled:{len(ingress._waiting)} processed:{self.processed}",
                 f"software -> sluiceway-worker celery:{celery.__version__} kombu:{kombu.__version__}"
                 f" redis-py:{redis.__version__} py:{platform.python_version()}",
                 f"platform -> system:{platform.system()} arch:{platform.machine()} kernel:{platform.release()}",
                 f"settings -> transport:redis queue:{ingress.celery_queue} prefetch:{ingress.prefetch}"
                 f" results:{censored(str(ingress.app.conf.result_backend or 'disabled'))}",
                 "", *(f"{key}: {value!r}" for key, value in settings.items())]
        return {"ok": "\n".join(lines) + "\n"}

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
