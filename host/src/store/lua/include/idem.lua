--[[
  Shared fragment: an idempotency record, and moving one to a new state.

  The record is JSON {task_id, state, updated_at, fingerprint}. Written
  here (`idemRecord`), its first fields are laid out so that a change of
  state rewrites them in place:

    {"task_id":"<id>","state":<S>,"updated_at":<13 digits>,"fingerprint":...}

  where <S> is the state quoted and padded with spaces to the width of the
  longest ('"processing"', '"completed" ', '"failed"    ': whitespace
  JSON allows). A record of any other shape (one written with cjson, whose
  key order is Lua's, a forward, a time of another width) is as valid, and
  is read and rewritten whole.
]]
local IDEM_TOKENS = {
  processing = '"processing"', completed = '"completed" ', failed = '"failed"    ' }
local IDEM_TOKEN_WIDTH = 12
local IDEM_TIME = ',"updated_at":'
-- The width of a time in ms since the epoch from 2001 to 2286.
local IDEM_TIME_WIDTH = 13

-- The record of `taskId` in `state` at `now`, for `fingerprint`, in the
-- layout above (cjson's, for a time of another width). Both strings are
-- the host's, which need no JSON escape: a task id is a UUID (with a
-- partition's ".<n>"), a fingerprint a hex digest (store/keys.rs,
-- ingest/validate.rs). A check of each character here would cost more
-- than cjson's encoding.
local function idemRecord(taskId, state, now, fingerprint)
  now = tostring(now)
  if IDEM_TOKENS[state] and #now == IDEM_TIME_WIDTH then
    return '{"task_id":"' .. taskId .. '","state":' .. IDEM_TOKENS[state] .. IDEM_TIME .. now
      .. ',"fingerprint":"' .. fingerprint .. '"}'
  end
  return cjson.encode({
    task_id = taskId, state = state, updated_at = tonumber(now), fingerprint = fingerprint })
end

--[[
  Move an idempotency record to `state`. Written with SET ... XX KEEPTTL
  (or SETRANGE, which keeps the expiry too, on a record that exists): never
  created here, and its expiry is kept. A record that names another task
  (the key was re-acquired after a stale record) is left alone.

  A record in the layout above naming `taskId` has its state and time
  overwritten in place: its head is read (GETRANGE) and compared, instead
  of the whole record read, decoded and encoded again (about half the
  Redis work of a keyed completion's record). Anything else found there,
  or nothing, is read whole.

  Returns 1 when the record was rewritten, 0 otherwise.
]]
-- The offsets a head of `n` bytes puts the state and the time's end at,
-- as strings: `redis.call` turns a number into one with `sprintf`, about
-- 2 000 instructions each time, and a batch's task ids are of one length.
local idemOffsets = {}

local function setIdemState(idemKey, taskId, state, now)
  local token = IDEM_TOKENS[state]
  local time = tostring(now)
  if token and #time == IDEM_TIME_WIDTH then
    local head = '{"task_id":"' .. taskId .. '","state":'
    local at = #head
    local offsets = idemOffsets[at]
    if not offsets then
      -- The head, the state's token, the time's name, the time and the
      -- comma after it.
      offsets = { tostring(at), tostring(at + IDEM_TOKEN_WIDTH + #IDEM_TIME + IDEM_TIME_WIDTH) }
      idemOffsets[at] = offsets
    end
    local got = redis.call("GETRANGE", idemKey, "0", offsets[2])
    if string.find(got, head, 1, true) == 1
      and string.find(got, '^"[a-z]+" *,"updated_at":%d+,$', at + 1) then
      redis.call("SETRANGE", idemKey, offsets[1], token .. IDEM_TIME .. time)
      return 1
    end
  end
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
