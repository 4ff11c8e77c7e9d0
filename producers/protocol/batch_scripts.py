"""The Lua scripts of the OpenAI Batch API's store (``gateway/batch_feeder.py``,
``gateway/batch_lines.py``, ``gateway/batch_answers.py``), beside protocol v1's own
(``producers.protocol.scripts`` and ``worker_scripts``).

Each script's KEYS and ARGV are listed above it. Every key of one call is one batch's
(``BatchKeys``: its id in braces is their hash tag), so each call touches one Redis Cluster
slot; a batch's jobs are submitted and cancelled with protocol v1's scripts.
"""

from __future__ import annotations

# NOTE: a batch's line is answered exactly once however often a feeder collects it (a feeder
# that lost its lease, or one that took over after a kill): the answered set is the guard, and
# the line, its counter and its byte count are written in the same script.
# KEYS: batch hash, answered bitmap (bit N: line N), pending hash, the output or error list.
# ARGV: line number, the line's job ids, space-separated (one per prompt; '' for a line that
# never had a job), the line to append ('' to append none: a cancelled job), the counter to
# increment ('completed', 'failed' or ''), the byte counter of the list ('output_bytes' /
# 'errors_bytes'). Returns 1 when the line was answered now, 0 when it had been already.
ANSWER_LINE_SCRIPT = """
for id in string.gmatch(ARGV[2], '[^ ]+') do redis.call('HDEL', KEYS[3], id) end
if redis.call('SETBIT', KEYS[2], ARGV[1], 1) == 1 then return 0 end
if ARGV[3] ~= '' then
  redis.call('RPUSH', KEYS[4], ARGV[3])
  redis.call('HINCRBY', KEYS[1], ARGV[5], string.len(ARGV[3]))
end
if ARGV[4] ~= '' then redis.call('HINCRBY', KEYS[1], ARGV[4], 1) end
return 1
"""

# NOTE: with a files directory a batch's output and error lines are appended to their files as
# they are answered, not kept in Redis; the holder appends at the offset Redis recorded and
# then records the new offsets and the lines' bits here, in one step. A holder killed between
# the two leaves bytes past the recorded offset, which the next write (or the next holder, on
# takeover) cuts off: a line is in its file exactly once. A holder that lost its lease, or
# whose offsets are no longer Redis's, records nothing.
# KEYS: batch hash, answered bitmap, pending hash, lease key. ARGV: holder id, output_bytes
# before and after the append, errors_bytes before and after, then (line number, the line's job
# ids space-separated or '', counter or '') triples. Returns the number of lines answered now;
# -1: not the lease's holder; -2: the offsets moved under it.
RECORD_ANSWERS_SCRIPT = """
if redis.call('GET', KEYS[4]) ~= ARGV[1] then return -1 end
local out = tonumber(redis.call('HGET', KEYS[1], 'output_bytes') or '0')
local err = tonumber(redis.call('HGET', KEYS[1], 'errors_bytes') or '0')
if out ~= tonumber(ARGV[2]) or err ~= tonumber(ARGV[4]) then return -2 end
redis.call('HSET', KEYS[1], 'output_bytes', ARGV[3], 'errors_bytes', ARGV[5])
local i, n = 6, 0
while ARGV[i] do
  for id in string.gmatch(ARGV[i + 1], '[^ ]+') do redis.call('HDEL', KEYS[3], id) end
  if redis.call('SETBIT', KEYS[2], ARGV[i], 1) == 0 then
    if ARGV[i + 2] ~= '' then redis.call('HINCRBY', KEYS[1], ARGV[i + 2], 1) end
    n = n + 1
  end
  i = i + 3
end
return n
"""

# NOTE: a batch whose completion window has passed ends expired, never cancelled, as on OpenAI
# (a batch that has expired cannot be cancelled): the feeder flags it (stop=expire) at its
# first pass after expires_at and then cancels its jobs itself, so a cancel from then on (or
# from expires_at on, before a pass has flagged it) must not turn its stop into 'cancel'.
# KEYS: batch hash. ARGV: now, the status to move to (cancelling), then the statuses a cancel
# moves from (validating, in_progress). Returns 1 when it moved (stop=cancel, cancelling_at=now),
# 0 when the batch had another status, -1 when its window has passed (it ends expired).
CANCEL_BATCH_SCRIPT = """
local status = redis.call('HGET', KEYS[1], 'status')
local i, allowed = 3, false
while ARGV[i] do
  if ARGV[i] == status then allowed = true end
  i = i + 1
end
if not allowed then return 0 end
local expires_at = tonumber(redis.call('HGET', KEYS[1], 'expires_at') or '')
if redis.call('HGET', KEYS[1], 'stop') == 'expire' or (expires_at and tonumber(ARGV[1]) > expires_at) then
  return -1
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'cancelling_at', ARGV[1], 'stop', 'cancel')
return 1
"""

# KEYS: the lease key. ARGV: holder id. Deletes the lease if the caller holds it (a clean stop
# hands its batches on at once rather than after the TTL).
RELEASE_LEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: the lease key. ARGV: holder id, TTL in ms. Returns 1 while the caller holds the lease.
RENEW_LEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# NOTE: a batch's status moves only from the status its mover saw: a cancel that lands while
# the feeder finishes validating wins or loses as a whole, never half.
# KEYS: batch hash. ARGV: new status, the time field to set ('' for none), now, then the
# statuses it may move from. Extra field/value pairs to set follow after a '--'.
# Returns 1 when it moved, 0 when the batch had another status.
MOVE_BATCH_SCRIPT = """
local status = redis.call('HGET', KEYS[1], 'status')
local i, allowed = 4, false
while ARGV[i] and ARGV[i] ~= '--' do
  if ARGV[i] == status then allowed = true end
  i = i + 1
end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], ARGV[2], ARGV[3]) end
i = i + 1
while ARGV[i + 1] do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  i = i + 2
end
return 1
"""
