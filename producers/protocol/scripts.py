"""The producer's Lua scripts of protocol v1, submit and cancel, and the key lists a client
passes them (``submit_keys``, ``cancel_keys``). The worker's scripts (start, finish, write,
append, dead letter, heartbeat), and why a job ends exactly once, fenced and all or nothing,
are ``worker_scripts``; the Batch API's own, which the gateway runs on its files and batches,
are ``batch_scripts``.

Each script's KEYS and ARGV are listed above it. Which statuses end a job comes from
``TERMINAL_STATUSES`` alone: the worker scripts' ``is_terminal`` and the cancel script's test
for a live job are generated from it (``lua_status_test``).
"""

from __future__ import annotations

from producers.protocol.keys import Keys
from producers.protocol.statuses import LIVE_STATUSES, Status


def lua_status_test(statuses: frozenset[Status], op: str, join: str) -> str:
    """A Lua expression comparing ``status`` by ``op`` with each of ``statuses`` (in ``Status``
    order, so the scripts' text stays put), joined by ``join``."""
    return f" {join} ".join(f"status {op} '{s.value}'" for s in Status if s in statuses)


_UNLESS_LIVE = lua_status_test(LIVE_STATUSES, "~=", "and")

# NOTE: submission is one script so that "enqueue unless the id is already known" is atomic
# and still pipelines (a WATCH/MULTI per job would cost a round trip each). A job id that is
# queued, running or ended is never enqueued again; a fresh id clears any stale signal keys.
# KEYS: job hash, queue stream, done list, tokens stream, cancel key.
# ARGV: job JSON, enqueued_at, queue name, stream flag ('1' / '0'; optional: with it the hash
# also records the flag and the entry id, which a cancel of the queued job uses).
# Returns the stream entry id, or nil when skipped.
SUBMIT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5])
local entry = redis.call('XADD', KEYS[2], '*', 'job', ARGV[1], 'hash', KEYS[1])  -- first: a refused XADD leaves no hash behind
redis.call('HSET', KEYS[1], 'status', 'queued', 'attempts', '0', 'queue', ARGV[3], 'enqueued_at', ARGV[2])
if ARGV[4] then redis.call('HSET', KEYS[1], 'stream', ARGV[4], 'queued_entry', entry) end
return entry
"""

# NOTE: a queued job that no worker has started is ended here, at once, the way a worker ends
# one, and its queue entry is deleted: a web app's cancel must not wait for the backlog in
# front of the job. A worker that already read the entry finds the job ended and only
# acknowledges it. A running job (or a queued one submitted without the stream field) gets
# the cancel key, which its worker polls. Atomic against a worker's start script, so exactly
# one of the two ends the job.
# KEYS: job hash, done list, tokens stream, cancel key, the job's queue stream (its ``queue`` field).
# ARGV: cancel key TTL, now, result TTL (seconds the ended job's keys are kept).
# Returns the status the job had before the call ('queued' or 'running' when it had not
# ended, else its terminal status), or nil for a job with no hash (its key is set all the same:
# a Celery task or an entry written without the script gets its hash only when a worker reads it).
CANCEL_SCRIPT = f"""
local status = redis.call('HGET', KEYS[1], 'status')
if not status then  -- no hash yet (a Celery task, a hand-made entry): its worker checks the key
  redis.call('SET', KEYS[4], '1', 'EX', ARGV[1])
  return false
end
if {_UNLESS_LIVE} then return status end
local stream = redis.call('HGET', KEYS[1], 'stream')
if status == 'running' or not stream then
  redis.call('SET', KEYS[4], '1', 'EX', ARGV[1])
  return status
end
local entry = redis.call('HGET', KEYS[1], 'queued_entry')
if entry then redis.pcall('XDEL', KEYS[5], entry) end  -- pcall: the producer role may not XDEL; a worker drops it
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[2], 'error', 'cancelled before it started',
           'error_code', 'cancelled')
redis.call('EXPIRE', KEYS[1], ARGV[3])
if stream == '1' then
  redis.call('XADD', KEYS[3], '*', 'index', '0', 'text', '', 'token_ids', '[]', 'finish_reason', 'cancelled')
  redis.call('EXPIRE', KEYS[3], ARGV[3])
end
redis.call('RPUSH', KEYS[2], 'cancelled')
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[4])
return status
"""


def submit_keys(keys: Keys, job_id: str, queue: str) -> list[str]:
    """The KEYS of ``SUBMIT_SCRIPT`` for one job, in order."""
    return [keys.job(job_id), keys.queue_for(queue, job_id), keys.done(job_id), keys.tokens(job_id),
            keys.cancel(job_id)]


def cancel_keys(keys: Keys, job_id: str, queue: str) -> list[str]:
    """The KEYS of ``CANCEL_SCRIPT`` for one job of ``queue``, in order."""
    return [keys.job(job_id), keys.done(job_id), keys.tokens(job_id), keys.cancel(job_id),
            keys.queue_for(queue, job_id)]


# The Batch API's scripts moved to their own module; these names stay importable from here.
from producers.protocol.batch_scripts import (  # noqa: E402,F401
    ANSWER_LINE_SCRIPT,
    MOVE_BATCH_SCRIPT,
    RECORD_ANSWERS_SCRIPT,
    RELEASE_LEASE_SCRIPT,
    RENEW_LEASE_SCRIPT,
)
