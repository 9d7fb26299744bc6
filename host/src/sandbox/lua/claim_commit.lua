--[[
  Commit an idempotent operation: apply its staged kv writes and mark its
  claim done, in one atomic step, only if the caller still owns the claim.

  The writes are checked before any is applied (an INCRBY of a key that does
  not hold an integer, or that would leave the range where Lua's numbers
  are exact, 2^53; the bytes they and the kept result leave against the
  namespace's budget, include/quota.lua), so a refused commit writes
  nothing. Claim, count and kv keys share the namespace's hash tag, so this
  is one Redis Cluster slot.

  A commit whose reply was lost is sent again by its owner: finding the
  claim done by the same owner, it answers "committed" and writes nothing.

  Input:
    KEYS[1] the claim        dtq:claim:{<namespace>}:<key>
    KEYS[2..4]               the quota's (include/quota.lua)
    KEYS[5..] the kv key of each staged write, in order
                             dtq:guest:{<namespace>}:<key>

    ARGV by name (the ARG_ and W_ locals below, after the quota's:
    ARG_KV_PREFIX, ARG_CLAIM_PREFIX, ARG_BUDGET; sandbox/operation.rs,
    COMMIT_ARGV and WRITE_ARGV):
    ARG_TOKEN   owner token
    ARG_RESULT  the operation's result (JSON text)
    then, per staged write i (from 0), from ARG_WRITES + 4i, its values at
    these offsets:
      W_OP     "set", "incrby", "del" or "expire"
      W_VALUE  set: the value; incrby: the delta; expire: seconds; del: ""
      W_NX     set: "nx" to write only when absent, else ""; others: ""
      W_EX     set: expire seconds, or ""; others: ""

  Output: a state and one value
    "committed", "1"        applied now
    "committed", "0"        applied before, by this owner's earlier commit
    "lost", state           the claim is not this owner's (taken over,
                            expired: state "gone"); nothing applied
    "refused", reason       a write cannot apply; nothing applied, and the
                            claim is released so that a retry may run it
    "quota", used           the writes and the result would pass the
                            budget; as "refused"
]]
local ARG_TOKEN = 4
local ARG_RESULT = 5
local ARG_WRITES = 6

-- A staged write's values, by their offsets from where it starts.
local W_OP = 0
local W_VALUE = 1
local W_NX = 2
local W_EX = 3

local claimKey = KEYS[1]
local token, result = ARGV[ARG_TOKEN], ARGV[ARG_RESULT]
-- The first staged write's kv key.
local FIRST = 5
local claimSuffix = string.sub(claimKey, #Q.claimPrefix + 1)

-- Release the claim: a retry may run the operation.
local function release()
  redis.call("DEL", claimKey)
  dropClaim(claimSuffix)
end

local c = redis.call("HMGET", claimKey, "state", "owner")
local state, owner = c[1], c[2]
if not state then
  return { "lost", "gone" }
end
if owner ~= token then
  return { "lost", state }
end
if state == "done" then
  return { "committed", "0" }
end

local EXACT = 9007199254740992
-- The integer at `key` as the writes before it leave it; false if it holds
-- something else. `seen` holds the values the writes checked so far left.
local seen = {}
local function integerAt(key)
  local v = seen[key]
  if v == nil then
    local reply = redis.pcall("GET", key)
    if type(reply) == "table" and reply.err then
      return false
    end
    v = reply or "0"
  end
  if v == false then
    v = "0"
  end
  if not string.match(v, "^-?%d+$") or #v > 17 then
    return false
  end
  return tonumber(v)
end

for i = FIRST, #KEYS do
  local a = ARG_WRITES + 4 * (i - FIRST)
  local op, key = ARGV[a + W_OP], KEYS[i]
  if op == "set" then
    local applies = ARGV[a + W_NX] ~= "nx" or seen[key] == false
      or (seen[key] == nil and redis.call("EXISTS", key) == 0)
    if applies then
      seen[key] = ARGV[a + W_VALUE]
    end
  elseif op == "incrby" then
    local current = integerAt(key)
    if not current then
      release()
      return { "refused", "incr-by: a key does not hold an integer" }
    end
    local n = current + tonumber(ARGV[a + W_VALUE])
    if n >= EXACT or n <= -EXACT then
      release()
      return { "refused", "incr-by: the value would overflow" }
    end
    seen[key] = string.format("%d", n)
  elseif op == "del" then
    seen[key] = false
  elseif op ~= "expire" then
    return redis.error_reply("ERR unknown staged write " .. tostring(op))
  end
end

-- The bytes the writes and the result leave, against the budget.
local now = redisTimeMs()
reconcile(now, 8)
local claimField = "c:" .. claimSuffix
local function delta()
  local d = claimSize(claimSuffix, #result) - sizeOf(claimField)
  for key, value in pairs(seen) do
    local suffix = string.sub(key, #Q.kvPrefix + 1)
    local size = value and kvSize(suffix, #value) or 0
    d = d + size - sizeOf("k:" .. suffix)
  end
  return d
end
if not fits(now, delta) then
  local used = usedOf()
  release()
  return { "quota", tostring(used) }
end

-- The claim first: under maxmemory Redis refuses a write that may grow
-- memory only while the script has written nothing, so either this one is
-- refused and nothing of the commit is written, or all of it is.
redis.call("HSET", claimKey, "state", "done", "result", result, "done_at", now)
record(claimField, claimSize(claimSuffix, #result))
local left = redis.call("PTTL", claimKey)
if left > 0 then
  redis.call("ZADD", Q.claimsKey, now + left, claimSuffix)
end
for i = FIRST, #KEYS do
  local a = ARG_WRITES + 4 * (i - FIRST)
  local op, key = ARGV[a + W_OP], KEYS[i]
  local value, ex = ARGV[a + W_VALUE], ARGV[a + W_EX]
  local suffix = string.sub(key, #Q.kvPrefix + 1)
  if op == "set" then
    local cmd = { "SET", key, value }
    if ARGV[a + W_NX] == "nx" then
      cmd[#cmd + 1] = "NX"
    end
    if ex ~= "" then
      cmd[#cmd + 1] = "EX"
      cmd[#cmd + 1] = ex
    end
    if redis.call(unpack(cmd)) then
      if ex ~= "" then
        redis.call("ZADD", Q.ttlKey, now + tonumber(ex) * 1000, suffix)
      else
        redis.call("ZREM", Q.ttlKey, suffix)
      end
    end
  elseif op == "incrby" then
    redis.call("INCRBY", key, value)
  elseif op == "del" then
    redis.call("DEL", key)
    redis.call("ZREM", Q.ttlKey, suffix)
  elseif redis.call("EXPIRE", key, value) == 1 then
    redis.call("ZADD", Q.ttlKey, now + tonumber(value) * 1000, suffix)
  end
end
-- Each key written is charged as it now is.
for key, _ in pairs(seen) do
  local suffix = string.sub(key, #Q.kvPrefix + 1)
  local size = 0
  if redis.call("EXISTS", key) == 1 then
    size = kvSize(suffix, redis.call("STRLEN", key))
  end
  record("k:" .. suffix, size)
end
return { "committed", "1" }
