--[[
  Shared fragment: move an idempotency record to a new state.

  The record is JSON {task_id, state, updated_at, fingerprint}. It is written
  with SET ... XX KEEPTTL: never created here, and its expiry is kept. A
  record that names another task (the key was re-acquired after a stale
  record) is left alone.

  Returns 1 when the record was rewritten, 0 otherwise.
]]
local function setIdemState(idemKey, taskId, state, now)
  local raw = redis.call("GET", idemKey)
  if not raw then
    return 0
  end
  local rec = cjson.decode(raw)
  if rec["task_id"] ~= taskId then
    return 0
  end
  rec["state"] = state
  rec["updated_at"] = tonumber(now)
  redis.call("SET", idemKey, cjson.encode(rec), "XX", "KEEPTTL")
  return 1
end

--[[
  Shared fragment: the task other than `taskId` that idempotency record
  `idemKey` names, if the key is taken by it; false otherwise. A record
  names its key's task, and a task of this slot when it is a plain record
  (its hash is `taskPrefix` .. id, read here although not in KEYS: it
  shares the record's hash tag, so the same cluster slot): taken while that
  hash exists (a record whose task is gone is stale, as ingest.lua treats
  it). A forward (`forward` set: the key's records live in another
  partition, see store/dlq.rs) names a task of another slot, which cannot
  be read here: taken as long as it names another task.
]]
local function idemTakenBy(idemKey, taskId, taskPrefix)
  local raw = redis.call("GET", idemKey)
  if not raw then
    return false
  end
  local rec = cjson.decode(raw)
  local owner = rec["task_id"]
  if owner == taskId then
    return false
  end
  if rec["forward"] or redis.call("EXISTS", taskPrefix .. owner) == 1 then
    return owner
  end
  return false
end

--[[
  Shared fragment: append a lifecycle event to the capped events stream;
  a cap of 0 writes none (`--events none`).
]]
local function addEvent(eventsKey, maxLen, taskId, status, attempt, now)
  if maxLen == "0" or maxLen == 0 then
    return
  end
  redis.call("XADD", eventsKey, "MAXLEN", "~", maxLen, "*",
    "task_id", taskId, "status", status, "attempt", attempt, "at", now)
end

--[[
  Shared fragment: the lifecycle events of a script that writes many (a
  batch), as few stream entries: `pushEvent` collects one, `flushEvents`
  writes those collected, at most EVENTS_PER_ENTRY per entry, one pair
  per event: the task id, and "<status> <attempt> <at>" (store/events.rs
  reads both this and addEvent's entries). One XADD per batch instead of
  one per task, and two values per event instead of eight.
]]
local EVENTS_PER_ENTRY = 128
local pendingEvents = {}

local function pushEvent(taskId, status, attempt, now)
  local n = #pendingEvents
  pendingEvents[n + 1], pendingEvents[n + 2] = taskId, status .. " " .. attempt .. " " .. now
end

local function flushEvents(eventsKey, maxLen)
  local n = #pendingEvents
  if n == 0 or maxLen == "0" or maxLen == 0 then
    return
  end
  local per = EVENTS_PER_ENTRY * 2
  for first = 1, n, per do
    redis.call("XADD", eventsKey, "MAXLEN", "~", maxLen, "*",
      unpack(pendingEvents, first, math.min(first + per - 1, n)))
  end
  pendingEvents = {}
end
