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
    then, per task hash k (from 0), in the same order:
    ARGV[5 + 2k] its stream message id
    ARGV[6 + 2k] its task id

  Output: one entry per message, in order:
    {1, task}     RUN: the task, now RUNNING, counting this attempt
    {0, status}   SKIP: already terminal, or its hash is gone; the message
                  was acknowledged and deleted here
    {4, task}     EXPIRED: not started before its expiry; the caller
                  completes it as EXPIRED
    {5, task}     EXHAUSTED: found RUNNING (its worker died) with no
                  attempts left; the caller dead-letters it
  where task is the list of the fields in `FIELDS` below, in that order,
  nil for a field the hash lacks (the host's `StartedTask` mirrors it).

  Events: RUNNING for each started task.
]]
local FIELDS = { "status", "attempts", "max_attempts", "expires_at", "task", "payload",
  "timeout_ms", "idempotency_key", "cancel_requested" }
local STATUS, ATTEMPTS, MAX_ATTEMPTS, EXPIRES_AT = 1, 2, 3, 4

local streamKey, eventsKey = KEYS[1], KEYS[2]
local group, now, consumer, eventsMaxLen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local nowMs = tonumber(now)

local waiting = { QUEUED = true, SCHEDULED = true, RETRYING = true }
local out = {}
local acks = {}
for i = 3, #KEYS do
  local taskKey, msgId, taskId = KEYS[i], ARGV[2 * i - 1], ARGV[2 * i]
  local task = redis.call("HMGET", taskKey, unpack(FIELDS))
  local status = task[STATUS]
  if not status or not (waiting[status] or status == "RUNNING") then
    acks[#acks + 1] = msgId
    out[#out + 1] = {0, status or "MISSING"}
  else
    local attempts = tonumber(task[ATTEMPTS] or "0")
    if waiting[status] and task[EXPIRES_AT] and nowMs >= tonumber(task[EXPIRES_AT]) then
      out[#out + 1] = {4, task}
    elseif status == "RUNNING" and attempts >= tonumber(task[MAX_ATTEMPTS] or "1") then
      out[#out + 1] = {5, task}
    else
      -- Numbers become strings once: Lua formats them slowly.
      local attempt = tostring(attempts + 1)
      redis.call("HSET", taskKey, "status", "RUNNING", "attempts", attempt, "started_at", now,
        "updated_at", now, "worker", consumer, "msg_id", msgId)
      task[STATUS], task[ATTEMPTS] = "RUNNING", attempt
      addEvent(eventsKey, eventsMaxLen, taskId, "RUNNING", attempt, now)
      out[#out + 1] = {1, task}
    end
  end
end
if #acks > 0 then
  redis.call("XACK", streamKey, group, unpack(acks))
  redis.call("XDEL", streamKey, unpack(acks))
end
return out
