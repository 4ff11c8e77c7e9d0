"""The Lua script the worker's Celery ingress takes a message off a kombu Redis queue with
(``worker/celery_taking.py``). Not part of protocol v1: the keys are kombu's (the queue, its
priority keys, ``unacked``, ``unacked_index``), and the entry written is kombu's own format."""

# KEYS: the queue's keys in kombu's priority order, then unacked, then unacked_index; ARGV[1]: now.
# Returns {key, message, 1 if it was recorded} or false (a message kombu cannot read is returned
# unrecorded: kombu fails it as before). The unacked entry is kombu's: [message, exchange, routing key],
# the message embedded as it came (re-encoding would turn its empty lists into objects).
TAKE = """
local n = #KEYS - 2
for i = 1, n do
  local raw = redis.call('RPOP', KEYS[i])
  if raw then
    local recorded = 0
    local ok, message = pcall(cjson.decode, raw)
    if ok and type(message) == 'table' and type(message.properties) == 'table' then
      local tag = message.properties.delivery_tag
      local info = message.properties.delivery_info
      if type(tag) == 'string' and type(info) == 'table' then
        recorded = 1
        redis.call('ZADD', KEYS[n + 2], ARGV[1], tag)
        redis.call('HSET', KEYS[n + 1], tag,
                   '[' .. raw .. ', ' .. cjson.encode(info.exchange or '') .. ', ' .. cjson.encode(info.routing_key or '') .. ']')
      end
    end
    return {KEYS[i], raw, recorded}
  end
end
return false
"""
