--[[
  Start a batch of fetched (or reclaimed, or read back) stream messages:
  decide for each whether it runs, and mark the runnable ones RUNNING with
  one more attempt.

  Per delivery: a start is keyed by its message and consumer. The same
  message started again by the same consumer (its earlier `start` ran but
  the reply was lost, or the worker read the message back after a broken
  connection) finds the task RUNNING by that consumer on that message: it
  resumes that attempt, writing nothing (no new attempt, no second RUNNING
  event). A RUNNING task's message started by another consumer was
  reclaimed from a dead worker (reclaim.lua): a new attempt, or EXHAUSTED
  when none is left. A message other than the one the RUNNING task names
  is a duplicate: it is acknowledged and deleted, never run beside the
  running attempt.

  Bad data is contained: a task key that is not a hash, or a hash that a
  runnable task cannot be read from (no task name or payload, a count that
  is not a number), fails that task alone, checked before anything is
  written for it. A key of another type is kept whole (DUMP, in hex) in
  field `corrupt_record` of the hash written in its place; fields a
  reader needs that the record lacks are filled in (task name
  "(unknown)", a null payload), so that it reads as a dead-lettered
  task with its error, listed in the queue's DLQ. The other tasks of the
  batch start as if it were not there. (Its idempotency record, not in
  KEYS, stays "processing" until its TTL.)

  Input:
    KEYS[1] ready stream   dtq:stream:{q}
    KEYS[2] events stream  dtq:events:{q}
    KEYS[3] expiry index   dtq:expiry:{q}
    KEYS[4] dead letters   dtq:dlq:{q}
    KEYS[5..] one task hash per message, dtq:task:{q}:<id>

    ARGV by name (the ARG_ locals below; store/start.rs, START_ARGV):
    ARG_GROUP           consumer group
    ARG_NOW             now (ms since epoch)
    ARG_CONSUMER        consumer (worker) name
    ARG_EVENTS_MAX_LEN  events stream max length
    ARG_QUEUE_NAME      the queue's name, written into a record rebuilt as
                        a dead letter
    then from ARG_DELIVERIES, per task hash k (from 0), in the same order:
      its stream message id, its task id

  Output: one flat array, a record per message in order, each a code and
  what follows it:
    1, task     RUN: the task, RUNNING, counting this attempt (a new one,
                or the one this consumer already started on this message)
    0, status   SKIP: already terminal, its hash is gone ("MISSING"), or
                RUNNING on another message ("RUNNING": a duplicate); the
                message was acknowledged and deleted here
    4, task     EXPIRED: not started before its expiry; the caller
                completes it as EXPIRED
    5, task     EXHAUSTED: found RUNNING on this message by another
                consumer (its worker died) with no attempts left; the
                caller dead-letters it
    6, error    CORRUPT: its record is not a readable task; it is
                DEAD_LETTERED (in the DLQ) with `error`, its message
                acknowledged and deleted here
  where task is the 8 values of `RETURNED` below, in that order, false for
  a field the hash lacks (the host's `StartedTask` mirrors it; the last,
  `traceparent`, only a traced submission wrote). Flat,
  because Redis converts each table of a script's reply on its own (seven
  field lookups and a length written back): nested, the reply cost Redis
  5 500 instructions more per message.

  Events: RUNNING for each task started (not for one resumed), DEAD_LETTERED
  for each corrupt one, one stream entry for the batch.

  Expiry index: a task with an expiry leaves it here whatever the
  decision (it starts, it is expired by the caller, or it is already
  terminal), so that the workers' sweep (expire.lua) never expires a task
  this script handed to a worker. Tasks without an expiry skip the ZREM.
]]
local FIELDS = { "status", "attempts", "max_attempts", "expires_at", "task", "payload",
  "timeout_ms", "idempotency_key", "cancel_requested", "worker", "msg_id", "traceparent" }
local STATUS, ATTEMPTS, MAX_ATTEMPTS, EXPIRES_AT, TASK, PAYLOAD = 1, 2, 3, 4, 5, 6
local WORKER, MSG_ID = 10, 11
-- The fields that must be numbers when present.
local NUMERIC = { 2, 3, 4, 7 }
-- The fields the caller gets, as indexes into FIELDS.
local RETURNED = { 2, 3, 5, 6, 7, 8, 9, 12 }

local ARG_GROUP = 1
local ARG_NOW = 2
local ARG_CONSUMER = 3
local ARG_EVENTS_MAX_LEN = 4
local ARG_QUEUE_NAME = 5
local ARG_DELIVERIES = 6

local streamKey, eventsKey, expiryKey, dlqKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, now, consumer = ARGV[ARG_GROUP], ARGV[ARG_NOW], ARGV[ARG_CONSUMER]
local eventsMaxLen, queueName = ARGV[ARG_EVENTS_MAX_LEN], ARGV[ARG_QUEUE_NAME]
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

-- Why a runnable task's fields cannot be started from, or nil.
local function unreadable(task)
  if not task[TASK] or not task[PAYLOAD] then
    return "its record has no task name or payload"
  end
  for _, j in ipairs(NUMERIC) do
    if task[j] and not tonumber(task[j]) then
      return "its record's field " .. FIELDS[j] .. " is not a number"
    end
  end
  return nil
end

-- Fail the task of `taskKey` alone: nothing was written for it before.
-- A key of another type is replaced by a hash keeping it whole.
local function contain(taskKey, taskId, msgId, err, notHash)
  if notHash then
    local kind = redis.call("TYPE", taskKey)["ok"]
    -- Hex: a hash field readers take as text.
    local kept = string.gsub(redis.call("DUMP", taskKey), ".", function(c)
      return string.format("%02x", string.byte(c))
    end)
    err = "its record is a " .. kind ..
      ", not a hash; kept in field corrupt_record (DUMP format, in hex)"
    redis.call("DEL", taskKey)
    redis.call("HSET", taskKey, "corrupt_record", kept)
  end
  -- What a reader needs of a record, where it is missing: a task name no
  -- handler can have ("(unknown)") and a null payload.
  local needed = { id = taskId, queue = queueName, task = "(unknown)", payload = "null",
    attempts = "0", created_at = now }
  for field, value in pairs(needed) do
    redis.call("HSETNX", taskKey, field, value)
  end
  err = "task not started: " .. err
  -- Dead-lettered, not FAILED: an operator finds it in the DLQ, with the
  -- record kept (no retention TTL, as for any dead letter) until purged.
  redis.call("HSET", taskKey, "status", "DEAD_LETTERED", "error", err, "updated_at", now,
    "finished_at", now)
  redis.call("PERSIST", taskKey)
  redis.call("ZADD", dlqKey, now, taskId)
  redis.call("ZREM", expiryKey, taskId)
  pushEvent(taskId, "DEAD_LETTERED", "0", now)
  acks[#acks + 1] = msgId
  out[n + 1], out[n + 2] = 6, err
  n = n + 2
end

local function skip(msgId, status)
  acks[#acks + 1] = msgId
  out[n + 1], out[n + 2] = 0, status
  n = n + 2
end

local function begin(taskKey, taskId, msgId, task)
  local attempt = nextCount(task[ATTEMPTS] or "0")
  redis.call("HSET", taskKey, "status", "RUNNING", "attempts", attempt, "started_at", now,
    "updated_at", now, "worker", consumer, "msg_id", msgId)
  task[ATTEMPTS] = attempt
  pushEvent(taskId, "RUNNING", attempt, now)
  emit(1, task)
end

for i = 5, #KEYS do
  local d = ARG_DELIVERIES + 2 * (i - 5)
  local taskKey, msgId, taskId = KEYS[i], ARGV[d], ARGV[d + 1]
  -- pcall: a key of another type answers WRONGTYPE, which would end the
  -- script with the writes made for the tasks before it kept.
  local task = redis.pcall("HMGET", taskKey, unpack(FIELDS))
  local status = task[STATUS]
  if task.err then
    contain(taskKey, taskId, msgId, nil, true)
  elseif not status or not (waiting[status] or status == "RUNNING") then
    if task[EXPIRES_AT] then
      redis.call("ZREM", expiryKey, taskId)
    end
    skip(msgId, status or "MISSING")
  elseif unreadable(task) then
    contain(taskKey, taskId, msgId, unreadable(task), false)
  else
    if task[EXPIRES_AT] then
      redis.call("ZREM", expiryKey, taskId)
    end
    if waiting[status] then
      if task[EXPIRES_AT] and nowMs >= tonumber(task[EXPIRES_AT]) then
        emit(4, task)
      else
        begin(taskKey, taskId, msgId, task)
      end
    elseif task[MSG_ID] and task[MSG_ID] ~= msgId then
      -- RUNNING on another message: this one is a duplicate.
      skip(msgId, "RUNNING")
    elseif task[WORKER] == consumer then
      -- This consumer's attempt on this message: its start again.
      emit(1, task)
    elseif tonumber(task[ATTEMPTS] or "0") >= tonumber(task[MAX_ATTEMPTS] or "1") then
      emit(5, task)
    else
      begin(taskKey, taskId, msgId, task)
    end
  end
end
flushEvents(eventsKey, eventsMaxLen)
if #acks > 0 then
  redis.call("XACK", streamKey, group, unpack(acks))
  redis.call("XDEL", streamKey, unpack(acks))
end
return out
