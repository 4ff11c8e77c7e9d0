"""What the fault tests of ``test_held_up.py`` read from Redis and from the worker process."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from producers.protocol import CONSUMER_GROUP, Keys
from tests.worker.test_process import WorkerProcess

KEYS = Keys()
TERMINAL = {"done", "failed", "cancelled", "expired"}
OBSERVER = "held-up-observer"  # the test's own connections, which the flap test spares


def observer(url: str) -> redis.Redis:
    """A str-returning client whose connections carry ``OBSERVER`` as their name."""
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=60, client_name=OBSERVER)


def statuses(r: redis.Redis, ids: list[str]) -> list[str | None]:
    with r.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(KEYS.job(job_id), "status")
        return pipe.execute()


def count(r: redis.Redis, ids: list[str], status: str) -> int:
    return statuses(r, ids).count(status)


def all_ended(r: redis.Redis, ids: list[str]) -> bool:
    return all(s in TERMINAL for s in statuses(r, ids))


def assert_each_ended_once(r: redis.Redis, ids: list[str], allowed: set[str] = frozenset({"done"})) -> list[str]:
    """Every job has a terminal status in ``allowed`` and exactly one done signal, that status."""
    with r.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(KEYS.job(job_id), "status")
            pipe.lrange(KEYS.done(job_id), 0, -1)
        replies = pipe.execute()
    ends = replies[0::2]
    signals = replies[1::2]
    wrong = [(j, s, d) for j, s, d in zip(ids, ends, signals) if s not in allowed or d != [s]]
    assert not wrong, f"{len(wrong)} jobs did not end exactly once in {sorted(allowed)}: {wrong[:5]}"
    return ends


def assert_nothing_left(r: redis.Redis, queues: tuple[str, ...] = ("interactive", "bulk")) -> None:
    """No entry waits or is held in any queue, and nothing was dead-lettered."""
    for queue in queues:
        key = KEYS.queue(queue)
        held = r.xpending(key, CONSUMER_GROUP)["pending"] if r.exists(key) else 0
        assert (r.xlen(key) if r.exists(key) else 0, held) == (0, 0), f"{queue}: entries left"
    assert r.xlen(KEYS.dead) == 0, r.xrange(KEYS.dead, count=3)


def streamed_tokens(r: redis.Redis, job_id: str) -> tuple[list[int], str]:
    """The token ids and text of completion 0 as its token stream holds them."""
    token_ids, text = [], ""
    for _, fields in r.xrange(KEYS.tokens(job_id)):
        if fields.get("index", "0") == "0":
            token_ids += json.loads(fields.get("token_ids") or "[]")
            text += fields.get("text", "")
    return token_ids, text


def rss_bytes(proc: WorkerProcess, field: str = "VmRSS") -> int:
    """The worker's resident set (``VmRSS``) or its peak (``VmHWM``), from /proc."""
    for line in Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {proc.proc.pid}")


def kill_other_clients(admin: redis.Redis) -> int:
    """``CLIENT KILL`` every connection but the observers' (the worker's, kombu's): how many died."""
    me = admin.client_id()
    victims = [c["id"] for c in admin.client_list() if c.get("name") != OBSERVER and int(c["id"]) != me]
    killed = 0
    for client_id in victims:
        killed += admin.execute_command("CLIENT", "KILL", "ID", client_id)
    return killed
