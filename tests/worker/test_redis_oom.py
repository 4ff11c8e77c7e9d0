"""Redis out of memory (maxmemory + noeviction) mid-run: every write waits and is retried."""

from __future__ import annotations

import time

from producers.client import Client
from producers.protocol import Keys
from tests.worker.conftest import CLIENT_KWARGS, pending_count, wait_for

KEYS = Keys()


def error_replies(r) -> int:
    """Error replies the server sent (a refused script counts once, whatever its command's error)."""
    return r.info("stats")["total_error_replies"]


def fields_of(r, ids: list[str], *names: str) -> list[list]:
    pipe = r.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(KEYS.job(job_id), *names)
    return pipe.execute()


def test_300_jobs_through_a_redis_that_runs_out_of_memory_mid_run_each_end_once(start_worker, redis_server_factory,
                                                                                make_engine):
    server = redis_server_factory(extra_args=["--maxmemory", "512mb", "--maxmemory-policy", "noeviction"])
    r = server.client(decode_responses=True)
    sampling = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    with Client(server.url, **CLIENT_KWARGS) as client:
        ids = client.submit_many([{"prompt": f"job {i}", "sampling": sampling} for i in range(300)])
    # A short claim window: a job whose end was dropped would be claimed and run again at once.
    worker = start_worker(make_engine(max_num_seqs=16), url=server.url, claim_idle_seconds=0.5, max_attempts=3).worker
    wait_for(lambda: sum(s == "done" for s, in fields_of(r, ids, "status")) >= 40, timeout=60, what="40 jobs done")
    wait_for(lambda: len(worker.engine) >= 8, what="jobs in the engine")
    # Fill memory with a big key, and set maxmemory below what is used: every write that may grow
    # memory (starts, token deltas, ends, dead letters) is refused with -OOM.
    base = r.info("memory")["used_memory"]
    r.set("ballast", b"x" * (32 << 20))
    r.config_set("maxmemory", base + (8 << 20))
    assert r.info("memory")["used_memory"] > base + (16 << 20)
    errors, ended, spell = error_replies(r), worker.finished, time.monotonic()
    # Jobs end in the engine while Redis refuses their results, and starts are refused again and
    # again. NOTE: the spell also outlasts the claim window three times over, so that an end or
    # a start given up on would be claimed and run again within it.
    wait_for(lambda: worker.finished >= ended + 4 and error_replies(r) >= errors + 50
             and time.monotonic() - spell > 1.5, timeout=30, what="jobs to end while Redis is out of memory")
    middle = sum(s == "done" for s, in fields_of(r, ids, "status"))
    r.delete("ballast")  # memory is back
    assert r.info("memory")["used_memory"] < base + (8 << 20)
    wait_for(lambda: all(s not in ("queued", "running") for s, in fields_of(r, ids, "status")), timeout=90,
             what="every job to end")
    assert middle < 300, "the out-of-memory spell should land mid-run"
    ended = fields_of(r, ids, "status", "attempts", "error")
    assert [e for e in ended if e[0] != "done" or e[1] != "1" or e[2] is not None] == []
    pipe = r.pipeline(transaction=False)
    for job_id in ids:
        pipe.lrange(KEYS.done(job_id), 0, -1)
    assert pipe.execute() == [["done"]] * 300
    assert r.xlen(KEYS.dead) == 0
    assert pending_count(r, "interactive") == 0 and r.xlen(KEYS.queue("interactive")) == 0
    r.close()
