"""The worker's Lua scripts of protocol v1: start, finish, write (token deltas, the end, a
release), append (many runs' deltas at once), dead letter and heartbeat, each after one
prelude of shared functions. (The producer's submit and cancel are ``scripts``.)

Each script's KEYS and ARGV are listed above it; ``worker/scripts.py`` binds them to a client
and spells out each one's key and argument lists. The prelude's ``is_terminal`` is generated
from ``TERMINAL_STATUSES`` (``scripts.lua_status_test``).

**Exactly once.** ``end_job`` (the worker scripts' prelude) is the only code that ends a job
under a worker. It refuses a job whose status is already terminal, so a job re-run after a
crash, claimed twice, or cancelled while finishing can never store two results or push two
done signals. The element it pushes on ``{prefix}:done:{id}`` is the job's terminal status,
in the same script that stores it, so a BLPOP wakes with the outcome already readable.
Acknowledging an entry also deletes it from its stream (``XACK`` + ``XDEL``): a queue
stream holds only jobs not yet finished, so its length is the backlog and it never grows
without bound.

**Fencing.** ``START`` makes the job hash name its run: ``status`` running, ``worker``,
``attempts`` (incremented by every start) and ``entry``. Every later write of that run --
token deltas, the end, a release, a heartbeat's claim -- passes the same owner token and
the script refuses it when the hash names another run (a worker frozen past the claim
time, whose jobs another worker took). A refused write changes nothing.
NOTE: ``attempts`` is a sound token although a release takes one back: only the run the
hash names can be released, so the number a release frees is that run's own, and no
other run can ever hold a number that a stale run still holds.

**All or nothing.** Under ``maxmemory`` Redis refuses a script at its first write that may
grow memory (``-OOM``) and lets it run to the end once it has written; so each worker
script's first write is one of those, and the key types are checked before anything is
written. A script that fails has changed nothing and can be retried, or its job failed,
as a whole.
"""

from __future__ import annotations

from producers.protocol.scripts import lua_status_test
from producers.protocol.statuses import TERMINAL_STATUSES


_IS_TERMINAL = f"""local function is_terminal(status)
  return {lua_status_test(TERMINAL_STATUSES, "==", "or")}
end
"""

# The worker's scripts: one prelude of shared functions, then one script per change of state.
_PRELUDE = """
local function ack(queue, group, entry_id)
  if entry_id ~= '' then
    redis.call('XACK', queue, group, entry_id)
    redis.call('XDEL', queue, entry_id)
  end
end

""" + _IS_TERMINAL + """
-- Ends a job exactly once: status, result or error, done signal, the tokens stream's last entry.
local function end_job(job, done, tokens, cancel, status, result, err, now, ttl, worker, stream, finish_reason, code)
  if is_terminal(redis.call('HGET', job, 'status')) then return 0 end
  redis.call('HSET', job, 'status', status, 'finished_at', now)
  if worker ~= '' then redis.call('HSET', job, 'worker', worker) end
  if result ~= '' then redis.call('HSET', job, 'result', result) end
  if err ~= '' then redis.call('HSET', job, 'error', err) end
  if code and code ~= '' then redis.call('HSET', job, 'error_code', code) end
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

-- An error reply naming the first key that holds another type than wanted ('none' is fine).
local function wrong_type(keys_and_types)
  for i = 1, #keys_and_types, 2 do
    local t = redis.call('TYPE', keys_and_types[i]).ok
    if t ~= 'none' and t ~= keys_and_types[i + 1] then
      return redis.error_reply('WRONGTYPE ' .. keys_and_types[i] .. ' holds a ' .. t .. ', not a ' .. keys_and_types[i + 1])
    end
  end
  return false
end

-- NOTE: a job's done list and tokens stream are its own protocol keys (the submit script
-- clears them too); when one holds another type, a failure end replaces it rather than
-- leave the job unended.
-- (Only a key that exists is deleted: any write, even a DEL of nothing, would let the
-- script's later writes pass the out-of-memory check.)
local function repair(done, tokens)
  local t = redis.call('TYPE', done).ok
  if t ~= 'none' and t ~= 'list' then redis.call('DEL', done) end
  t = redis.call('TYPE', tokens).ok
  if t ~= 'none' and t ~= 'stream' then redis.call('DEL', tokens) end
end

-- A tokens stream entry from the 7 arguments of one delta from ARGV[i] (see WRITE).
local function add_delta(tokens, i)
  local entry = {'index', ARGV[i], 'offset', ARGV[i + 1], 'text', ARGV[i + 2], 'token_ids', ARGV[i + 3]}
  if ARGV[i + 5] ~= '' then
    entry[#entry + 1] = 'logprobs'
    entry[#entry + 1] = ARGV[i + 5]
  end
  if ARGV[i + 6] ~= '' then
    entry[#entry + 1] = 'prompt'
    entry[#entry + 1] = ARGV[i + 6]
  end
  if ARGV[i + 4] ~= '' then
    entry[#entry + 1] = 'finish_reason'
    entry[#entry + 1] = ARGV[i + 4]
  end
  redis.call('XADD', tokens, '*', unpack(entry))
end

local function dead_letter(dead, raw, err, queue, entry_id, job_id, worker, now, code)
  redis.call('XADD', dead, 'MAXLEN', '~', '100000', '*', 'entry', raw, 'error', err, 'queue', queue,
             'entry_id', entry_id, 'job_id', job_id, 'worker', worker, 'at', now, 'error_code', code or '')
end
"""

# KEYS: job, done, tokens, cancel, queue, dead
# ARGV: group, entry_id, worker, now, enqueued_at (fallback), queue name, max_attempts, ttl,
#       stream ('1'/'0'), raw entry, job id, entry ref ('queue/entry_id')
# -> {'start', attempts, enqueued_at, progress, streamed} | {'ended', status} | {'duplicate', entry ref}
#    | {'cancelled', ''} | {'exhausted', attempts}
# ``progress`` is the job's progress checkpoint ('' when none): what an earlier run of a job
# that does not stream had generated, from which this run resumes; ``streamed`` the number of
# entries its tokens stream holds (an earlier run's, also one released at a stop, which does
# not count as an attempt), from which a streamed job resumes.
# NOTE: the tokens stream is never deleted here: a job that runs again resumes from the
# deltas already in it, and its new deltas continue their offsets (exact streams).
START = _PRELUDE + """
local bad = wrong_type({KEYS[1], 'hash', KEYS[2], 'list', KEYS[3], 'stream', KEYS[6], 'stream'})
if bad then return bad end
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
          ARGV[4], ARGV[8], ARGV[3], ARGV[9], 'cancelled', 'cancelled')
  ack(KEYS[5], ARGV[1], ARGV[2])
  return {'cancelled', ''}
end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
if attempts > tonumber(ARGV[7]) then
  attempts = redis.call('HINCRBY', KEYS[1], 'attempts', -1)
  local err = 'gave up after ' .. attempts .. ' attempts (max_attempts=' .. ARGV[7] ..
              '): each worker that took the job stopped before finishing it'
  dead_letter(KEYS[6], ARGV[10], err, ARGV[6], ARGV[2], ARGV[11], ARGV[3], ARGV[4], 'max_attempts_exceeded')
  end_job(KEYS[1], KEYS[2], KEYS[3], KEYS[4], 'failed', '', err, ARGV[4], ARGV[8], ARGV[3], ARGV[9], 'failed',
          'max_attempts_exceeded')
  ack(KEYS[5], ARGV[1], ARGV[2])
  return {'exhausted', tostring(attempts)}
end
-- The owner token of this run: worker, attempts and entry (see the module's docstring).
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[3], 'started_at', ARGV[4],
           'queue', ARGV[6], 'entry', ARGV[12])
redis.call('HSETNX', KEYS[1], 'enqueued_at', ARGV[5])
local at = redis.call('HMGET', KEYS[1], 'enqueued_at', 'progress')
return {'start', tostring(attempts), at[1], at[2] or '', tostring(redis.call('XLEN', KEYS[3]))}
"""

# An end by no run: a job failed at read time (invalid) or expired before it started.
# KEYS: job, done, tokens, cancel, queue, dead
# ARGV: group, entry_id, status, result, error, now, ttl, worker, stream, finish_reason,
#       raw entry ('' = no dead letter), queue name, job id, entry ref, error code ('' for none)
# -> 1 if this call ended the job, 0 if it had already ended (or another delivery of it runs)
FINISH = _PRELUDE + """
local bad = wrong_type({KEYS[1], 'hash', KEYS[6], 'stream'})
if bad then return bad end
repair(KEYS[2], KEYS[3])
if ARGV[11] ~= '' then
  dead_letter(KEYS[6], ARGV[11], ARGV[5], ARGV[12], ARGV[2], ARGV[13], ARGV[8], ARGV[6], ARGV[15])
end
local ended = 0
local status = redis.call('HGET', KEYS[1], 'status')
-- NOTE: a job that runs from another entry (a second delivery of its id) is left to that run.
if status ~= 'running' or redis.call('HGET', KEYS[1], 'entry') == ARGV[14] then
  ended = end_job(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[3], ARGV[4], ARGV[5], ARGV[6],
                  ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[15])
end
ack(KEYS[5], ARGV[1], ARGV[2])
return ended
"""

# Everything one run writes in one writer round, fenced on the run's owner token: its token
# deltas, then optionally its end ('finish'; 'fail' for the end that fails a job whose own
# writes could not be stored, which repairs its done and tokens keys) or its release
# ('release': status queued again, this start not counted, the entry left pending but made
# idle, so the next XAUTOCLAIM of any live worker takes it).
# The run's progress checkpoint (the output token ids it has generated, as JSON) goes in the
# same call, fenced like the rest: a stale run can never overwrite the owner's progress.
# KEYS: job, done, tokens, cancel, queue, dead
# ARGV: group, entry_id, worker, attempt, entry ref, now, ttl, stream, end ('', 'finish', 'fail', 'release'),
#       status, result, error, finish_reason, idle_ms, error code ('' for none), progress ('' = none),
#       then 7 per delta: index, offset, text, token_ids, finish_reason, logprobs ('' for none: v1.2),
#       prompt ('' for none: v1.4, a JSON object of the prompt's text, first token and logprobs)
# -> 'written' | 'ended' (this call ended the job) | 'released' | 'ended_before' | 'fenced'
WRITE = _PRELUDE + """
local ending = ARGV[9] == 'finish' or ARGV[9] == 'fail'
local bad = wrong_type({KEYS[1], 'hash'})
if not bad and ARGV[9] ~= 'fail' then bad = wrong_type({KEYS[2], 'list', KEYS[3], 'stream'}) end
if bad then return bad end
local owner = redis.call('HMGET', KEYS[1], 'status', 'worker', 'attempts', 'entry')
if is_terminal(owner[1]) then
  if ending then ack(KEYS[5], ARGV[1], ARGV[2]) end  -- ended is ended: the entry goes too
  return 'ended_before'
end
if owner[1] ~= 'running' or owner[2] ~= ARGV[3] or owner[3] ~= ARGV[4] or owner[4] ~= ARGV[5] then
  return 'fenced'
end
if ARGV[9] == 'fail' then repair(KEYS[2], KEYS[3]) end
if #ARGV > 16 then
  for i = 17, #ARGV, 7 do add_delta(KEYS[3], i) end
  redis.call('EXPIRE', KEYS[3], ARGV[7])
end
if not ending and ARGV[16] and ARGV[16] ~= '' then
  redis.call('HSET', KEYS[1], 'progress', ARGV[16])
end
if ending then
  end_job(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[10], ARGV[11], ARGV[12], ARGV[6], ARGV[7], ARGV[3],
          ARGV[8], ARGV[13], ARGV[15])
  redis.call('HDEL', KEYS[1], 'progress')  -- after end_job's first write: see "All or nothing"
  ack(KEYS[5], ARGV[1], ARGV[2])
  return 'ended'
end
if ARGV[9] == 'release' then
  redis.call('HSET', KEYS[1], 'status', 'queued')
  redis.call('HINCRBY', KEYS[1], 'attempts', -1)
  redis.call('HDEL', KEYS[1], 'started_at')
  local owned = redis.call('XPENDING', KEYS[5], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3])
  if #owned > 0 then
    redis.call('XCLAIM', KEYS[5], ARGV[1], ARGV[3], 0, ARGV[2], 'IDLE', ARGV[14], 'JUSTID')
  end
  return 'released'
end
return 'written'
"""

# The token deltas and checkpoints of a round for many runs that neither end nor are released, in
# one call (NOTE: a call per run was about one per streamed token): each run is checked for key
# types and fenced on its own owner token exactly as WRITE checks and fences such a run, and a
# run refused writes nothing. All or nothing as a whole: the first write is the first run's.
# KEYS: 3 per run: job, done, tokens
# ARGV: worker, ttl, then per run: attempt, entry ref, progress ('' = none), number of deltas,
#       then 7 per delta, as WRITE's
# -> one code per run: 'written' | 'ended_before' | 'fenced' | 'WRONGTYPE ...' (WRITE's error text)
APPEND = _PRELUDE + """
local codes, a = {}, 3
for k = 1, #KEYS, 3 do
  local n, code = tonumber(ARGV[a + 3]), 'written'
  local bad = wrong_type({KEYS[k], 'hash', KEYS[k + 1], 'list', KEYS[k + 2], 'stream'})
  local owner = bad or redis.call('HMGET', KEYS[k], 'status', 'worker', 'attempts', 'entry')
  if bad then code = bad.err
  elseif is_terminal(owner[1]) then code = 'ended_before'
  elseif owner[1] ~= 'running' or owner[2] ~= ARGV[1] or owner[3] ~= ARGV[a] or owner[4] ~= ARGV[a + 1] then
    code = 'fenced'
  else
    for i = a + 4, a + 3 + 7 * n, 7 do add_delta(KEYS[k + 2], i) end
    if n > 0 then redis.call('EXPIRE', KEYS[k + 2], ARGV[2]) end
    if ARGV[a + 2] ~= '' then redis.call('HSET', KEYS[k], 'progress', ARGV[a + 2]) end
  end
  codes[#codes + 1] = code
  a = a + 4 + 7 * n
end
return codes
"""

# An entry with no readable job id: dead letter and acknowledge.
# KEYS: dead, queue; ARGV: group, entry_id, raw entry, error, queue name, worker, now, error code
DEAD = _PRELUDE + """
local bad = wrong_type({KEYS[1], 'stream'})
if bad then return bad end
dead_letter(KEYS[1], ARGV[3], ARGV[4], ARGV[5], ARGV[2], '', ARGV[6], ARGV[7], ARGV[8])
ack(KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# Reset the idle time of the entries whose runs this worker still owns (never steals one back).
# KEYS: queue, then the job hash of each entry
# ARGV: group, consumer (the worker), then 3 per entry: entry id, attempt, entry ref
# -> one code per entry: 1 beat, 0 the job has ended, -1 fenced (another consumer holds the
#    entry, or the hash names another run)
HEARTBEAT = _PRELUDE + """
local codes = {}
for i = 2, #KEYS do
  local a = 3 + (i - 2) * 3
  local entry_id = ARGV[a]
  local t = redis.call('TYPE', KEYS[i]).ok
  local f = {}  -- a job key of another type names no run: fenced, without failing the other beats
  if t == 'hash' then f = redis.call('HMGET', KEYS[i], 'status', 'worker', 'attempts', 'entry')
  elseif t ~= 'none' then f = {'', '', '', ''} end
  local owned = #redis.call('XPENDING', KEYS[1], ARGV[1], entry_id, entry_id, 1, ARGV[2]) > 0
  -- NOTE: an entry with no job hash (deleted by hand) is kept alive on the consumer group alone.
  local mine = not f[1] or (f[1] == 'running' and f[2] == ARGV[2] and f[3] == ARGV[a + 1] and f[4] == ARGV[a + 2])
  if is_terminal(f[1]) then
    codes[#codes + 1] = 0
  elseif owned and mine then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, entry_id, 'JUSTID')
    codes[#codes + 1] = 1
  else
    codes[#codes + 1] = -1
  end
end
return codes
"""
