--[[
  Commit an idempotent operation: apply its staged kv writes and mark its
  claim done, in one atomic step, only if the caller still owns the claim.

  The writes are checked before any is applied (an INCRBY of a key that does
  not hold an integer, or that would leave the range where Lua's numbers
  are exact, 2^53; the bytes they leave against the namespace's budget,
  include/quota.lua), so a refused commit writes nothing. Claim, count and
  kv keys share the namespace's hash tag, so this is one Redis Cluster slot.

  A commit whose reply was lost is sent again by its owner: finding the
  claim done by the same owner, it answers "committed" and writes nothing.

  Input:
    KEYS[1] the claim        dtq:claim:{<namespace>}:<key>
    KEYS[2] the namespace's count   dtq:quota:{<namespace>}
    KEYS[3] its TTL index           dtq:quota-ttl:{<namespace>}
    KEYS[4..] the kv key of each staged write, in order
                             dtq:guest:{<namespace>}:<key>

    ARGV[1] owner token
    ARGV[2] the operation's result (JSON text)
    ARGV[3] the kv keys' prefix     dtq:guest:{<namespace>}:
    ARGV[4] the namespace's budget in bytes, "0" for none
    then, per staged write i (from 0), 4 values from ARGV[5 + 4i]:
      "set", value, "nx" or "", expire seconds or ""
      "incrby", delta, "", ""
      "del", "", "", ""
      "expire", seconds, "", ""

  Output: a state and one value
    "committed", "1"        applied now
    "committed", "0"        applied before, by this owner's earlier commit
    "lost", state           the claim is not this owner's (taken over,
                            expired: state "gone"); nothing applied
    "refused", reason       a write cannot apply; nothing applied, and the
                            claim is released so that a retry may run it
    "quota", used           the writes would pass the budget; as "refused"
]]
local claimKey, quotaKey, ttlKey = KEYS[1], KEYS[2], KEYS[3]
local token, result, prefix, budget = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local FIRST = 4

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
  local a = 5 + 4 * (i - FIRST)
  local op, key = ARGV[a], KEYS[i]
  if op == "set" then
    local applies = ARGV[a + 2] ~= "nx" or seen[key] == false
      or (seen[key] == nil and redis.call("EXISTS", key) == 0)
    if applies then
      seen[key] = ARGV[a + 1]
    end
  elseif op == "incrby" then
    local current = integerAt(key)
    if not current then
      redis.call("DEL", claimKey)
      return { "refused", "incr-by: a key does not hold an integer" }
    end
    local n = current + tonumber(ARGV[a + 1])
    if n >= EXACT or n <= -EXACT then
      redis.call("DEL", claimKey)
      return { "refused", "incr-by: the value would overflow" }
    end
    seen[key] = string.format("%d", n)
  elseif op == "del" then
    seen[key] = false
  elseif op ~= "expire" then
    return redis.error_reply("ERR unknown staged write " .. tostring(op))
  end
end

-- The bytes the writes leave, against the budget.
local now = nowMs()
local delta = 0
for key, value in pairs(seen) do
  local suffix = string.sub(key, #prefix + 1)
  local size = value and (#suffix + #value) or 0
  delta = delta + size - sizeOf(quotaKey, suffix)
end
if not fits(quotaKey, delta, budget) then
  redis.call("DEL", claimKey)
  return { "quota", tostring(usedOf(quotaKey)) }
end

-- The claim first: under maxmemory a script's first write is the one Redis
-- may refuse, and then nothing is written.
redis.call("HSET", claimKey, "state", "done", "result", result, "done_at", now)
reconcile(quotaKey, ttlKey, prefix, now, 8)
for i = FIRST, #KEYS do
  local a = 5 + 4 * (i - FIRST)
  local op, key = ARGV[a], KEYS[i]
  local suffix = string.sub(key, #prefix + 1)
  if op == "set" then
    local cmd = { "SET", key, ARGV[a + 1] }
    if ARGV[a + 2] == "nx" then
      cmd[#cmd + 1] = "NX"
    end
    if ARGV[a + 3] ~= "" then
      cmd[#cmd + 1] = "EX"
      cmd[#cmd + 1] = ARGV[a + 3]
    end
    if redis.call(unpack(cmd)) then
      if ARGV[a + 3] ~= "" then
        redis.call("ZADD", ttlKey, now + tonumber(ARGV[a + 3]) * 1000, suffix)
      else
        redis.call("ZREM", ttlKey, suffix)
      end
    end
  elseif op == "incrby" then
    redis.call("INCRBY", key, ARGV[a + 1])
  elseif op == "del" then
    redis.call("DEL", key)
    redis.call("ZREM", ttlKey, suffix)
  elseif redis.call("EXPIRE", key, ARGV[a + 1]) == 1 then
    redis.call("ZADD", ttlKey, now + tonumber(ARGV[a + 1]) * 1000, suffix)
  end
end
-- Each key written is counted as it now is.
for key, value in pairs(seen) do
  local suffix = string.sub(key, #prefix + 1)
  local size = 0
  if redis.call("EXISTS", key) == 1 then
    size = #suffix + redis.call("STRLEN", key)
  end
  record(quotaKey, suffix, size)
end
return { "committed", "1" }
