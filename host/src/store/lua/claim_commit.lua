--[[
  Commit an idempotent operation: apply its staged kv writes and mark its
  claim done, in one atomic step, only if the caller still owns the claim.

  The writes are checked before any is applied (an INCRBY of a key that does
  not hold an integer, or that would leave the range where Lua's numbers
  are exact, 2^53), so a refused commit writes nothing. Claim and kv keys
  share the namespace's hash tag, so this is one Redis Cluster slot.

  A commit whose reply was lost is sent again by its owner: finding the
  claim done by the same owner, it answers "committed" and writes nothing.

  Input:
    KEYS[1] the claim        dtq:claim:{<namespace>}:<key>
    KEYS[2..] the kv key of each staged write, in order
                             dtq:guest:{<namespace>}:<key>

    ARGV[1] owner token
    ARGV[2] the operation's result (JSON text)
    then, per staged write i (from 0), 4 values from ARGV[3 + 4i]:
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
]]
local claimKey = KEYS[1]
local token, result = ARGV[1], ARGV[2]

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

for i = 2, #KEYS do
  local a = 3 + 4 * (i - 2)
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

-- The claim first: under maxmemory a script's first write is the one Redis
-- may refuse, and then nothing is written.
local t = redis.call("TIME")
redis.call("HSET", claimKey, "state", "done", "result", result, "done_at",
  tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
for i = 2, #KEYS do
  local a = 3 + 4 * (i - 2)
  local op, key = ARGV[a], KEYS[i]
  if op == "set" then
    local cmd = { "SET", key, ARGV[a + 1] }
    if ARGV[a + 2] == "nx" then
      cmd[#cmd + 1] = "NX"
    end
    if ARGV[a + 3] ~= "" then
      cmd[#cmd + 1] = "EX"
      cmd[#cmd + 1] = ARGV[a + 3]
    end
    redis.call(unpack(cmd))
  elseif op == "incrby" then
    redis.call("INCRBY", key, ARGV[a + 1])
  elseif op == "del" then
    redis.call("DEL", key)
  else
    redis.call("EXPIRE", key, ARGV[a + 1])
  end
end
return { "committed", "1" }
