"""The worker's Redis scripts: every change to a job's state is one atomic script.

``end_job`` is the only code that ends a job. It refuses a job whose status is already
terminal, so a job re-run after a crash, claimed twice, or cancelled while finishing can
never store two results or push two done signals. Acknowledging an entry also deletes it
from its stream (``XACK`` + ``XDEL``): a queue stream holds only jobs not yet finished, so
its length is the backlog and it never grows without bound.
"""

from __future__ import annotations

import redis

from producers.protocol import CONSUMER_GROUP, Keys

_PRELUDE = """
local function ack(queue, group, entry_id)
  if entry_id ~= '' then
    redis.call('XACK', queue, group, entry_id)
    redis.call('XDEL', queue, entry_id)
  end
end

local function is_terminal(status)
  return status == 'done' or status == 'failed' or status == 'cancelled' or status == 'expired'
end

-- Ends a job exactly once: status, result or error, done signal, the tokens stream's last entry.
local function end_job(job, done, tokens, cancel, status, result, err, now, ttl, worker, stream, finish_reason)
  if is_terminal(redis.call('HGET', job, 'status')) then return 0 end
  redis.call('HSET', job, 'status', status, 'finished_at', now)
  if worker ~= '' then redis.call('HSET', job, 'worker', worker) end
  if result ~= '' then redis.call('HSET', job, 'result', result) end
  if err ~= '' then redis.call('HSET', job, 'error', err) end
  redis.call('EXPIRE', job, ttl)
  if stream == '1' then
    if finish_reason ~= '' then
      redis.call('XADD', tokens, '*', 'index', '0', 'text', '', 'token_ids', '[]', 'finish_reason', finish_reason)
    end
    redis.call('EXPIRE', tokens, ttl)
  end
  redis.call('RPUSH', done, status)
  redis.call('EXPIRE', done, ttl)
  redis.call('DEL', cancel)
  return 1
end

local function dead_letter(dead, raw, err, queue, entry_id, job_id, worker, now)
  redis.call('XADD', dead, 'MAXLEN', '~', '100000', '*', 'entry', raw, 'error', err, 'queue', queue,
             'entry_id', entry_id, 'job_id', job_id, 'worker', worker, 'at', now)
end
"""

# KEYS: job, done, tokens, cancel, queue, dead
# ARGV: group, entry_id, worker, now, enqueued_at (fallback), queue name, max_attempts, ttl,
#       stream ('1'/'0'), raw entry, job id, entry ref ('queue/entry_id')
# -> {'start', attempts, enqueued_at} | {'ended', status} | {'duplicate', entry ref}
#    | {'cancelled', ''} | {'exhausted', attempts}
START = _PRELUDE + """
local status = redis.call('HGET', KEYS[1], 'status')
if is_terminal(status) then
  ack(KEYS[5], ARGV[1], ARGV[2])
  return {'ended', status}
end
if status == 'running' then
  local holder = redis.call('HGET', KEYS[1], 'entry')
  if holder and holder ~= ARGV[12] then
    ack(KEYS[5], ARGV[1], ARGV[2])
    return {'duplicate', holder}
  end
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  end_job(KEYS[1], KEYS[2], KEYS[3], KEYS[4], 'cancelled', '', 'cancelled before it started',
          ARGV[4], ARGV[8], ARGV[3], ARGV[9], 'cancelled')
  ack(KEYS[5], ARGV[1], ARGV[2])
  return {'cancelled', ''}
end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
if attempts > tonumber(ARGV[7]) then
  attempts = redis.call('HINCRBY', KEYS[1], 'attempts', -1)
  local err = 'gave up after ' .. attempts .. ' attempts (max_attempts=' .. ARGV[7] ..
              '): each worker that took the job stopped before finishing it'
  dead_letter(KEYS[6], ARGV[10], err, ARGV[6], ARGV[2], ARGV[11], ARGV[3], ARGV[4])
  end_job(KEYS[1], KEYS[2], KEYS[3], KEYS[4], 'failed', '', err, ARGV[4], ARGV[8], ARGV[3], ARGV[9], 'failed')
  ack(KEYS[5], ARGV[1], ARGV[2])
  return {'exhausted', tostring(attempts)}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[3], 'started_at', ARGV[4],
           'queue', ARGV[6], 'entry', ARGV[12])
redis.call('HSETNX', KEYS[1], 'enqueued_at', ARGV[5])
if ARGV[9] == '1' then
  redis.call('DEL', KEYS[3])  -- deltas of an interrupted earlier run: this run streams from the start
end
return {'start', tostring(attempts), redis.call('HGET', KEYS[1], 'enqueued_at')}
"""

# KEYS: job, done, tokens, cancel, queue, dead
# ARGV: group, entry_id, status, result, error, now, ttl, worker, stream, finish_reason,
#       raw entry ('' = no dead letter), queue name, job id
# -> 1 if this call ended the job, 0 if it had already ended
FINISH = _PRELUDE + """
if ARGV[11] ~= '' then
  dead_letter(KEYS[6], ARGV[11], ARGV[5], ARGV[12], ARGV[2], ARGV[13], ARGV[8], ARGV[6])
end
local ended = end_job(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[3], ARGV[4], ARGV[5], ARGV[6],
                      ARGV[7], ARGV[8], ARGV[9], ARGV[10])
ack(KEYS[5], ARGV[1], ARGV[2])
return ended
"""

# An entry with no readable job id: dead letter and acknowledge.
# KEYS: dead, queue; ARGV: group, entry_id, raw entry, error, queue name, worker, now
DEAD = _PRELUDE + """
dead_letter(KEYS[1], ARGV[3], ARGV[4], ARGV[5], ARGV[2], '', ARGV[6], ARGV[7])
ack(KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# Reset the idle time of entries this consumer still owns (never steals one back).
# KEYS: queue; ARGV: group, consumer, entry ids...
HEARTBEAT = """
local n = 0
for i = 3, #ARGV do
  local owned = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #owned > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    n = n + 1
  end
end
return n
"""

# Give a job back unfinished: status queued again (this start not counted), entry left
# pending but made idle at once, so the next XAUTOCLAIM of any live worker takes it.
# KEYS: job, queue; ARGV: group, consumer, entry_id, entry ref, idle_ms
RELEASE = """
if redis.call('HGET', KEYS[1], 'status') == 'running' and redis.call('HGET', KEYS[1], 'entry') == ARGV[4]
   and redis.call('HGET', KEYS[1], 'worker') == ARGV[2] then
  redis.call('HSET', KEYS[1], 'status', 'queued')
  redis.call('HINCRBY', KEYS[1], 'attempts', -1)
  redis.call('HDEL', KEYS[1], 'started_at')
end
local owned = redis.call('XPENDING', KEYS[2], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #owned > 0 then
  redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', ARGV[5], 'JUSTID')
  return 1
end
return 0
"""

RELEASE_IDLE_MS = 7 * 24 * 3600 * 1000  # older than any sane --claim-idle-seconds


class Scripts:
    """The scripts registered on one client, with their key lists spelled out once."""

    def __init__(self, client: redis.Redis, keys: Keys, worker: str, group: str = CONSUMER_GROUP) -> None:
        self.keys = keys
        self.worker = worker
        self.group = group
        self._start = client.register_script(START)
        self._finish = client.register_script(FINISH)
        self._dead = client.register_script(DEAD)
        self._heartbeat = client.register_script(HEARTBEAT)
        self._release = client.register_script(RELEASE)

    def _job_keys(self, job_id: str, queue: str) -> list[str]:
        k = self.keys
        return [k.job(job_id), k.done(job_id), k.tokens(job_id), k.cancel(job_id), k.queue(queue), k.dead]

    def start(self, pipe, *, job_id: str, queue: str, entry_id: str, now: float, enqueued_at: float,
              max_attempts: int, ttl: int, stream: bool, raw: str):
        args = [self.group, entry_id, self.worker, repr(now), repr(enqueued_at), queue, max_attempts, ttl,
                "1" if stream else "0", raw, job_id, entry_ref(queue, entry_id)]
        return self._start(keys=self._job_keys(job_id, queue), args=args, client=pipe)

    def finish(self, pipe, *, job_id: str, queue: str, entry_id: str | None, status: str, now: float, ttl: int,
               stream: bool, result: str = "", error: str = "", finish_reason: str = "", dead_raw: str = ""):
        args = [self.group, entry_id or "", status, result, error, repr(now), ttl, self.worker,
                "1" if stream else "0", finish_reason, dead_raw, queue, job_id]
        return self._finish(keys=self._job_keys(job_id, queue), args=args, client=pipe)

    def dead(self, pipe, *, queue: str, entry_id: str, raw: str, error: str, now: float):
        args = [self.group, entry_id, raw, error, queue, self.worker, repr(now)]
        return self._dead(keys=[self.keys.dead, self.keys.queue(queue)], args=args, client=pipe)

    def heartbeat(self, pipe, *, queue: str, entry_ids: list[str]):
        return self._heartbeat(keys=[self.keys.queue(queue)], args=[self.group, self.worker, *entry_ids], client=pipe)

    def release(self, pipe, *, job_id: str, queue: str, entry_id: str):
        args = [self.group, self.worker, entry_id, entry_ref(queue, entry_id), RELEASE_IDLE_MS]
        return self._release(keys=[self.keys.job(job_id), self.keys.queue(queue)], args=args, client=pipe)


def entry_ref(queue: str, entry_id: str) -> str:
    """How a job hash names the stream entry that holds it (its ``entry`` field)."""
    return f"{queue}/{entry_id}"
