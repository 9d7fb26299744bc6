--[[
  Requeue a dead-lettered task (admin): back to the ready stream with a fresh
  budget of attempts, and its idempotency record back to "processing", so that a
  resubmission with its key gets 409 (the task runs again) rather than a
  replay of the dead-lettered attempt. A record that expired meanwhile is
  recreated with a full TTL for the same reason.

  Input:
    KEYS[1] task hash            dtq:task:{q}:<id>
    KEYS[2] dead-letter set      dtq:dlq:{q}
    KEYS[3] ready stream         dtq:stream:{q}
    KEYS[4] events stream        dtq:events:{q}
    KEYS[5] idempotency record   dtq:idempotency:{q}:<key> (ignored unless ARGV[3] == "1")

    ARGV[1] task id
    ARGV[2] now (ms since epoch)
    ARGV[3] "1" when the task has an idempotency key
    ARGV[4] idempotency TTL (s), for a record that expired
    ARGV[5] events stream max length

  Output:
    {1, "QUEUED"}   requeued
    {-7, status}    not in the dead-letter set (status is the task's, or "")

  Attempts keep counting (a handler sees attempt numbers rise, never
  repeat); max_attempts grows by the task's original budget.

  Events: QUEUED.
]]
local taskKey, dlqKey, streamKey, eventsKey, idemKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local taskId, now, hasKey, idemTtl, eventsMaxLen =
  ARGV[1], ARGV[2], ARGV[3] == "1", tonumber(ARGV[4]), ARGV[5]

local status = redis.call("HGET", taskKey, "status")
if status ~= "DEAD_LETTERED" or redis.call("ZREM", dlqKey, taskId) == 0 then
  return {-7, status or ""}
end
local f = redis.call("HMGET", taskKey, "attempts", "budget", "max_attempts")
local attempts = tonumber(f[1] or "0")
local budget = tonumber(f[2] or f[3] or "1")
redis.call("HSET", taskKey, "status", "QUEUED", "max_attempts", attempts + budget,
  "updated_at", now, "requeued_at", now)
redis.call("HDEL", taskKey, "finished_at", "cancel_requested")
redis.call("PERSIST", taskKey)
redis.call("XADD", streamKey, "*", "id", taskId)
addEvent(eventsKey, eventsMaxLen, taskId, "QUEUED", attempts, now)
if hasKey and setIdemState(idemKey, taskId, "processing", now) == 0
    and redis.call("EXISTS", idemKey) == 0 then
  local fingerprint = redis.call("HGET", taskKey, "fingerprint") or ""
  redis.call("SET", idemKey, cjson.encode({
    task_id = taskId, state = "processing",
    updated_at = tonumber(now), fingerprint = fingerprint }), "EX", idemTtl)
end
return {1, "QUEUED"}
