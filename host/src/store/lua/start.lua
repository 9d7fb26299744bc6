--[[
  Start a batch of fetched (or reclaimed) stream messages: decide for each
  whether it runs, and mark the runnable ones RUNNING with one more attempt.

  Input:
    KEYS[1] ready stream   dtq:stream:{q}
    KEYS[2] events stream  dtq:events:{q}
    KEYS[3..] one task hash per message, dtq:task:{q}:<id>

    ARGV[1] consumer group
    ARGV[2] now (ms since epoch)
    ARGV[3] consumer (worker) name
    ARGV[4] events stream max length
    ARGV[5..] one stream message id per task hash, in the same order

  Output: one entry per message, in order:
    {1, fields...}  RUN: the task hash (after the update) as a flat list
    {0, status}     SKIP: already terminal, or its hash is gone; the message
                    was acknowledged and deleted here
    {4, fields...}  EXPIRED: not started before its expiry; the caller
                    completes it as EXPIRED (it needs the idempotency key)
    {5, fields...}  EXHAUSTED: found RUNNING (its worker died) with no
                    attempts left; the caller dead-letters it

  Events: RUNNING for each started task.
]]
local streamKey, eventsKey = KEYS[1], KEYS[2]
local group, now, consumer, eventsMaxLen = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]

local waiting = { QUEUED = true, SCHEDULED = true, RETRYING = true }
local out = {}
for i = 3, #KEYS do
  local taskKey, msgId = KEYS[i], ARGV[i + 2]
  local f = redis.call("HMGET", taskKey, "status", "id", "expires_at", "attempts", "max_attempts")
  local status, taskId = f[1], f[2]
  if not status or not (waiting[status] or status == "RUNNING") then
    redis.call("XACK", streamKey, group, msgId)
    redis.call("XDEL", streamKey, msgId)
    out[#out + 1] = {0, status or "MISSING"}
  else
    local expiresAt = tonumber(f[3] or "0")
    local attempts = tonumber(f[4] or "0")
    local maxAttempts = tonumber(f[5] or "1")
    if waiting[status] and expiresAt > 0 and now >= expiresAt then
      out[#out + 1] = {4, redis.call("HGETALL", taskKey)}
    elseif status == "RUNNING" and attempts >= maxAttempts then
      out[#out + 1] = {5, redis.call("HGETALL", taskKey)}
    else
      attempts = attempts + 1
      redis.call("HSET", taskKey, "status", "RUNNING", "attempts", attempts,
        "started_at", now, "updated_at", now, "worker", consumer, "msg_id", msgId)
      addEvent(eventsKey, eventsMaxLen, taskId, "RUNNING", attempts, now)
      out[#out + 1] = {1, redis.call("HGETALL", taskKey)}
    end
  end
end
return out
