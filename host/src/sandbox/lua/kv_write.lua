--[[
  One kv write of a handler, outside an idempotent operation, charged to
  its namespace's budget (include/quota.lua).

  Input:
    KEYS[1] the kv key            dtq:guest:{<ns>}:<key>
    KEYS[2..4]                    the quota's (include/quota.lua)

    ARGV by name (the ARG_ locals below, after the quota's: ARG_KV_PREFIX,
    ARG_CLAIM_PREFIX, ARG_BUDGET; sandbox/imports.rs, KV_WRITE_ARGV):
    ARG_OP     the write: "set", "incrby", "del" or "expire"
    ARG_VALUE  set: the value; incrby: the delta; expire: seconds
    ARG_NX     set: "nx" to write only when absent, else ""
    ARG_EX     set: expire seconds, or ""

  Output: a state and one value
    "ok", n          set: 1 written, 0 NX found the key; incrby: the new
                     value, as decimal text; del, expire: 1 when the key
                     existed, else 0
    "quota", used    over the budget: nothing written; the bytes charged
  A key holding a value of another type is Redis's own error (WRONGTYPE,
  not an integer), and so is a sum past 64 bits (overflow), before
  anything of the write.
]]
local ARG_OP = 4
local ARG_VALUE = 5
local ARG_NX = 6
local ARG_EX = 7

local key = KEYS[1]
local op, arg, nx, ex = ARGV[ARG_OP], ARGV[ARG_VALUE], ARGV[ARG_NX], ARGV[ARG_EX]
local suffix = string.sub(key, #Q.kvPrefix + 1)
local field = "k:" .. suffix
local now = redisTimeMs()
reconcile(now, 8)

if op == "set" then
  if nx == "nx" and redis.call("EXISTS", key) == 1 then
    return { "ok", 0 }
  end
  local size = kvSize(suffix, #arg)
  if not fits(now, function() return size - sizeOf(field) end) then
    return { "quota", usedOf() }
  end
  if ex ~= "" then
    redis.call("SET", key, arg, "EX", ex)
    redis.call("ZADD", Q.ttlKey, now + tonumber(ex) * 1000, suffix)
  else
    redis.call("SET", key, arg)
    redis.call("ZREM", Q.ttlKey, suffix)
  end
  record(field, size)
  return { "ok", 1 }
elseif op == "incrby" then
  -- At most 20 digits: the budget is checked for the longest the value can
  -- be, then the key is charged as it is.
  if not fits(now, function() return kvSize(suffix, 20) - sizeOf(field) end) then
    return { "quota", usedOf() }
  end
  -- Redis refuses a sum past 64 bits (an error the host hands the guest);
  -- the sum itself goes back as Redis's text, since a Lua number is exact
  -- only to 2^53 and would come back wrapped past 2^63.
  redis.call("INCRBY", key, arg)
  local value = redis.call("GET", key)
  record(field, kvSize(suffix, #value))
  return { "ok", value }
elseif op == "del" then
  local existed = redis.call("DEL", key)
  record(field, 0)
  redis.call("ZREM", Q.ttlKey, suffix)
  return { "ok", existed }
elseif op == "expire" then
  local exists = redis.call("EXPIRE", key, arg)
  if exists == 1 then
    redis.call("ZADD", Q.ttlKey, now + tonumber(arg) * 1000, suffix)
  end
  return { "ok", exists }
end
return redis.error_reply("ERR unknown kv write " .. tostring(op))
