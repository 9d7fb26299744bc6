--[[
  One kv write of a handler, outside an idempotent operation, counted
  against its namespace's budget (include/quota.lua).

  Input:
    KEYS[1] the kv key            dtq:guest:{<ns>}:<key>
    KEYS[2] the namespace's count dtq:quota:{<ns>}
    KEYS[3] its TTL index         dtq:quota-ttl:{<ns>}

    ARGV[1] the write: "set", "incrby", "del" or "expire"
    ARGV[2] the key's prefix      dtq:guest:{<ns>}:
    ARGV[3] set: the value; incrby: the delta; expire: seconds
    ARGV[4] set: "nx" to write only when absent, else ""
    ARGV[5] set: expire seconds, or ""
    ARGV[6] the budget in bytes, "0" for none

  Output: a state and one value
    "ok", n          set: 1 written, 0 NX found the key; incrby: the new
                     value; del, expire: 1 when the key existed, else 0
    "quota", used    over the budget: nothing written; the bytes counted
  A key holding a value of another type is Redis's own error (WRONGTYPE,
  not an integer), before anything of the write.
]]
local key, quotaKey, ttlKey = KEYS[1], KEYS[2], KEYS[3]
local op, prefix, arg, nx, ex, budget =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local suffix = string.sub(key, #prefix + 1)
local now = nowMs()
reconcile(quotaKey, ttlKey, prefix, now, 8)

if op == "set" then
  if nx == "nx" and redis.call("EXISTS", key) == 1 then
    return { "ok", 0 }
  end
  local size = #suffix + #arg
  if not fits(quotaKey, size - sizeOf(quotaKey, suffix), budget) then
    return { "quota", usedOf(quotaKey) }
  end
  if ex ~= "" then
    redis.call("SET", key, arg, "EX", ex)
    redis.call("ZADD", ttlKey, now + tonumber(ex) * 1000, suffix)
  else
    redis.call("SET", key, arg)
    redis.call("ZREM", ttlKey, suffix)
  end
  record(quotaKey, suffix, size)
  return { "ok", 1 }
elseif op == "incrby" then
  -- At most 20 digits: the budget is checked for the longest the value can
  -- be, then the key is counted as it is.
  if not fits(quotaKey, #suffix + 20 - sizeOf(quotaKey, suffix), budget) then
    return { "quota", usedOf(quotaKey) }
  end
  local value = redis.call("INCRBY", key, arg)
  record(quotaKey, suffix, #suffix + redis.call("STRLEN", key))
  return { "ok", value }
elseif op == "del" then
  local existed = redis.call("DEL", key)
  record(quotaKey, suffix, 0)
  redis.call("ZREM", ttlKey, suffix)
  return { "ok", existed }
elseif op == "expire" then
  local exists = redis.call("EXPIRE", key, arg)
  if exists == 1 then
    redis.call("ZADD", ttlKey, now + tonumber(arg) * 1000, suffix)
  end
  return { "ok", exists }
end
return redis.error_reply("ERR unknown kv write " .. tostring(op))
