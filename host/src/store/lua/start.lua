--[[
  Start a batch of fetched (or reclaimed) stream messages: decide for each
  whether it runs, and mark the runnable ones RUNNING with one more attempt.

  Input:
    KEYS[1] ready stream   dtq:stream:{q}
    KEYS[2] events stream  dtq:events:{q}
    KEYS[3] expiry index   dtq:expiry:{q}
    KEYS[4..] one task hash per message, dtq:task:{q}:<id>

    ARGV[1] consumer group
    ARGV[2] now (ms since epoch)
    ARGV[3] consumer (worker) name
    ARGV[4] events stream max length
    then, per task hash k (from 0), in the same order:
    ARGV[5 + 2k] its stream message id
    ARGV[6 + 2k] its task id

  Output: one flat array, a record per message in order, each a code and
  what follows it:
    1, task     RUN: the task, now RUNNING, counting this attempt
    0, status   SKIP: already terminal, or its hash is gone ("MISSING"); the
                message was acknowledged and deleted here
    4, task     EXPIRED: not started before its expiry; the caller
                completes it as EXPIRED
    5, task     EXHAUSTED: found RUNNING (its worker died) with no
                attempts left; the caller dead-letters it
  where task is the 7 values of `RETURNED` below, in that order, false for
  a field the hash lacks (the host's `StartedTask` mirrors it). Flat,
  because Redis converts each table of a script's reply on its own (seven
  field lookups and a length written back): nested, the reply cost Redis
  5 500 instructions more per message.

  Events: RUNNING for each started task, one stream entry for the batch.

  Expiry index: a task with an expiry leaves it here whatever the
  decision (it starts, it is expired by the caller, or it is already
  terminal), so that the workers' sweep (expire.lua) never expires a task
  this script handed to a worker. Tasks without an expiry skip the ZREM.
]]
local FIELDS = { "status", "attempts", "max_attempts", "expires_at", "task", "payload",
  "timeout_ms", "idempotency_key", "cancel_requested" }
local STATUS, ATTEMPTS, MAX_ATTEMPTS, EXPIRES_AT = 1, 2, 3, 4
-- The fields the caller gets, as indexes into FIELDS.
local RETURNED = { 2, 3, 5, 6, 7, 8, 9 }

local streamKey, eventsKey, expiryKey = KEYS[1], KEYS[2], KEYS[3]
local group, now, consumer, eventsMaxLen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local nowMs = tonumber(now)

local waiting = { QUEUED = true, SCHEDULED = true, RETRYING = true }
local out, n = {}, 0
local acks = {}

-- The decimal string `count` + 1. Lua's tostring formats through sprintf,
-- a cost per task; a one-digit count, the usual case, needs no formatting.
local NINE = string.byte("9")
local function nextCount(count)
  local digit = string.byte(count)
  if #count == 1 and digit < NINE then
    return string.char(digit + 1)
  end
  return tostring(tonumber(count) + 1)
end

local function emit(code, task)
  out[n + 1] = code
  for j = 1, #RETURNED do
    out[n + 1 + j] = task[RETURNED[j]]
  end
  n = n + 1 + #RETURNED
end

for i = 4, #KEYS do
  local taskKey, msgId, taskId = KEYS[i], ARGV[2 * i - 3], ARGV[2 * i - 2]
  local task = redis.call("HMGET", taskKey, unpack(FIELDS))
  local status = task[STATUS]
  if task[EXPIRES_AT] then
    redis.call("ZREM", expiryKey, taskId)
  end
  if not status or not (waiting[status] or status == "RUNNING") then
    acks[#acks + 1] = msgId
    out[n + 1], out[n + 2] = 0, status or "MISSING"
    n = n + 2
  else
    local attempts = task[ATTEMPTS] or "0"
    if waiting[status] and task[EXPIRES_AT] and nowMs >= tonumber(task[EXPIRES_AT]) then
      emit(4, task)
    elseif status == "RUNNING" and tonumber(attempts) >= tonumber(task[MAX_ATTEMPTS] or "1") then
      emit(5, task)
    else
      local attempt = nextCount(attempts)
      redis.call("HSET", taskKey, "status", "RUNNING", "attempts", attempt, "started_at", now,
        "updated_at", now, "worker", consumer, "msg_id", msgId)
      task[ATTEMPTS] = attempt
      pushEvent(taskId, "RUNNING", attempt, now)
      emit(1, task)
    end
  end
end
flushEvents(eventsKey, eventsMaxLen)
if #acks > 0 then
  redis.call("XACK", streamKey, group, unpack(acks))
  redis.call("XDEL", streamKey, unpack(acks))
end
return out
