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

  Input:
    KEYS[1] the claim      dtq:claim:{<namespace>}:<key>

    ARGV[1] owner token of the calling handler call
    ARGV[2] task id of the call
    ARGV[3] attempt of the call
    ARGV[4] TTL of a new claim (s)
    ARGV[5] lease (ms)
    ARGV[6] "1" when the operation has external effects, else "0"

  Output: a state and one value
    "run", "0"             a new claim (or this owner's own), run the effect
    "run", "1"             taken over from a dead owner
    "done", result         the stored result, false when none was stored
    "busy", task id        a live owner holds it
    "abandoned", task id   a dead owner's, with external effects
]]
local claimKey = KEYS[1]
local token, taskId, attempt, ttl, lease, external =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6]

local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local c = redis.call("HMGET", claimKey, "state", "owner", "task_id", "attempt", "lease_until",
  "external", "result")
local state, owner, ownerTask, ownerAttempt, leaseUntil, ownerExternal, result =
  c[1], c[2], c[3], c[4], c[5], c[6], c[7]

local function own()
  redis.call("HSET", claimKey, "state", "running", "owner", token, "task_id", taskId,
    "attempt", attempt, "lease_until", now + lease, "external", external)
end

if not state then
  own()
  redis.call("EXPIRE", claimKey, ttl)
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
