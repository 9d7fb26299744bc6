--[[
  Open an idempotent operation: take the claim on a key, find it done or
  held, or take it over from an owner that died.

  A claim is a hash: state ("running" or "done"), owner (a token unique to
  one handler call), task_id and attempt of that call, lease_until (ms,
  Redis clock), external ("1" when the operation reaches outside kv) and,
  once done, result. Its TTL is the operation's, set when the claim is
  first taken and kept after. The owner's host renews the lease while the
  call runs (claim_renew.lua); a process that dies stops renewing it.

  An owner is dead when its lease has ended, or when the caller is a later
  attempt of the owner's own task: the queue starts an attempt only once the
  task's previous one is over or its worker presumed dead (and a stale
  attempt is stopped; its commit would be refused here anyway). A dead
  owner's operation applied none of its kv writes (they apply only with the
  commit), so its claim is taken over; unless it had external effects, which
  may have happened: then the claim stays abandoned, at most once.

  A begin by the claim's own owner is the retry of a begin whose reply was
  lost; it is answered as the first one was.

  A new claim is charged to the namespace's budget (include/quota.lua) for
  its key and record, and indexed until it expires; it is refused when the
  budget has no room for it or the namespace holds its most live claims.

  Input:
    KEYS[1] the claim      dtq:claim:{<namespace>}:<key>
    KEYS[2..4]             the quota's (include/quota.lua)

    ARGV by name (the ARG_ locals below, after the quota's: ARG_KV_PREFIX,
    ARG_CLAIM_PREFIX, ARG_BUDGET; sandbox/operation.rs, BEGIN_ARGV):
    ARG_TOKEN       owner token of the calling handler call
    ARG_TASK_ID     task id of the call
    ARG_ATTEMPT     attempt of the call
    ARG_TTL         TTL of a new claim (s)
    ARG_LEASE       lease (ms)
    ARG_EXTERNAL    "1" when the operation has external effects, else "0"
    ARG_MAX_CLAIMS  the most live claims the namespace may hold

  Output: a state and one value
    "run", "0"             a new claim (or this owner's own), run the effect
    "run", "1"             taken over from a dead owner
    "done", result         the stored result, false when none was stored
    "busy", task id        a live owner holds it
    "abandoned", task id   a dead owner's, with external effects
    "quota", used          no room in the budget for a new claim; nothing
                           written; the bytes charged
    "claims", live         the namespace holds ARG_MAX_CLAIMS live claims already;
                           nothing written
]]
local ARG_TOKEN = 4
local ARG_TASK_ID = 5
local ARG_ATTEMPT = 6
local ARG_TTL = 7
local ARG_LEASE = 8
local ARG_EXTERNAL = 9
local ARG_MAX_CLAIMS = 10

local claimKey = KEYS[1]
local token, taskId, attempt = ARGV[ARG_TOKEN], ARGV[ARG_TASK_ID], ARGV[ARG_ATTEMPT]
local ttl, lease = ARGV[ARG_TTL], tonumber(ARGV[ARG_LEASE])
local external, maxClaims = ARGV[ARG_EXTERNAL], tonumber(ARGV[ARG_MAX_CLAIMS])

local now = redisTimeMs()

local c = redis.call("HMGET", claimKey, "state", "owner", "task_id", "attempt", "lease_until",
  "external", "result")
local state, owner, ownerTask, ownerAttempt, leaseUntil, ownerExternal, result =
  c[1], c[2], c[3], c[4], c[5], c[6], c[7]

local function own()
  redis.call("HSET", claimKey, "state", "running", "owner", token, "task_id", taskId,
    "attempt", attempt, "lease_until", now + lease, "external", external)
end

if not state then
  reconcile(now, 8)
  local live = liveClaims(now)
  if live >= maxClaims then
    return { "claims", tostring(live) }
  end
  local suffix = string.sub(claimKey, #Q.claimPrefix + 1)
  local size = claimSize(suffix, 0)
  if not fits(now, function() return size - sizeOf("c:" .. suffix) end) then
    return { "quota", tostring(usedOf()) }
  end
  own()
  redis.call("EXPIRE", claimKey, ttl)
  redis.call("ZADD", Q.claimsKey, now + tonumber(ttl) * 1000, suffix)
  record("c:" .. suffix, size)
  return { "run", "0" }
end
if state == "done" then
  return { "done", result or false }
end
if owner == token then
  return { "run", "0" }
end
local superseded = ownerTask == taskId and tonumber(ownerAttempt) < tonumber(attempt)
if tonumber(leaseUntil) > now and not superseded then
  return { "busy", ownerTask }
end
if ownerExternal == "1" then
  return { "abandoned", ownerTask }
end
own()
return { "run", "1" }
