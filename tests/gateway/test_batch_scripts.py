"""The Batch API's answer scripts on a private redis-server: a line of several jobs (a completions
line of several prompts) is answered once, and its jobs' pending entries go with the answer."""

from producers.connection import connect
from producers.protocol.batch_keys import BatchKeys
from producers.protocol.batch_scripts import ANSWER_LINE_SCRIPT, RECORD_ANSWERS_SCRIPT
from producers.scripting import register

KEYS = BatchKeys()
BATCH = "batch_scripts_test"


def test_a_line_of_several_jobs_is_answered_once_and_drops_every_entry(redis_server):
    r = connect(redis_server, decode_responses=True)
    try:
        batch, answered, pending = KEYS.batch(BATCH), KEYS.answered(BATCH), KEYS.pending(BATCH)
        jobs = [f"{BATCH}-{line}" + (f"-{i}" if i else "") for line in (1, 2) for i in range(3)]
        r.hset(pending, mapping={job: "{}" for job in jobs})
        r.hset(batch, mapping={"output_bytes": 0, "errors_bytes": 0})
        answer = register(r, ANSWER_LINE_SCRIPT)
        args = [1, " ".join(jobs[:3]), "line 1\n", "completed", "output_bytes"]
        assert answer(keys=[batch, answered, pending, KEYS.output(BATCH)], args=args) == 1
        assert answer(keys=[batch, answered, pending, KEYS.output(BATCH)], args=args) == 0  # once
        assert sorted(r.hkeys(pending)) == jobs[3:] and r.lrange(KEYS.output(BATCH), 0, -1) == ["line 1\n"]
        r.set(KEYS.lease(BATCH), "holder")
        record = register(r, RECORD_ANSWERS_SCRIPT)
        keys = [batch, answered, pending, KEYS.lease(BATCH)]
        assert record(keys=keys, args=["holder", 7, 14, 0, 0, 2, " ".join(jobs[3:]), "completed"]) == 1
        assert record(keys=keys, args=["holder", 14, 14, 0, 0, 2, " ".join(jobs[3:]), "completed"]) == 0
        assert not r.exists(pending) and r.hget(batch, "completed") == "2" and r.hget(batch, "output_bytes") == "14"
    finally:
        r.close()
