--[[
  Shared fragment: the admission of messages of a queue with limits
  (store/limits.rs), for `admit.lua` (messages delivered already) and
  `read_admit.lua` (messages it reads itself): a rate limit (at most
  RATE_LIMIT starts per window of RATE_PER_MS, windows counted by Redis's
  clock) and a group limit (at most GROUP_LIMIT running tasks of one
  `group`). A message admitted goes on to `start` (or runs as carried);
  one held is taken out of the stream and waits in the delayed set,
  SCHEDULED, with `held_by` ("rate" or "group") and `held_until` saying
  why and until when, and the delayed mover brings it back. A hold is
  neither an attempt nor a failure: nothing else of the task changes.

  Group slots: a set per group of the ids of the tasks holding one
  (GROUP_PREFIX .. group), scored by when each was admitted. A slot is
  given back lazily, when the group is next looked at here: a member whose
  task is no longer RUNNING (it ended, is waiting for a retry, or is gone)
  leaves, and so does one admitted longer than ADMIT_GRACE_MS ago that
  never started (its worker died between its admission and `start`; its
  message is reclaimed and admitted again). A task whose worker died while
  it ran stays RUNNING, holding its slot, until a reclaim starts it again
  (keeping the slot) or dead-letters it (giving it back): within the
  visibility timeout. A task already holding a slot (a reclaimed or
  resumed attempt) is admitted without charge, as is one not QUEUED
  (`start` decides what it is).

  A task held by its group is looked at again after GROUP_RETRY_MS,
  doubling with each hold (`held_count`) up to 16 times that; by its rate,
  at the start of the next window.

  Every script that includes this file takes the same three keys and nine
  arguments first:
    KEYS[1] ready stream   dtq:stream:{q}
    KEYS[2] delayed set    dtq:delayed:{q}
    KEYS[3] rate window    dtq:rate:{q}: hash, the window `w` and starts
            counted in it `n`

    ARGV by name (the ARG_ locals below, the first of every such script's
    own; store/limits.rs, ADMISSION_ARGV):
    ARG_GROUP           consumer group
    ARG_NOW             now (ms since epoch, the worker's: updated_at)
    ARG_RATE_LIMIT      starts per window, 0 for no rate limit
    ARG_RATE_PER_MS     the window (ms)
    ARG_GROUP_LIMIT     running tasks per group, 0 for no group limit
    ARG_GROUP_PREFIX    prefix of the group sets, dtq:group:{q}:
    ARG_TASK_PREFIX     prefix of task hashes, dtq:task:{q}:
    ARG_GROUP_RETRY_MS  first delay of a task held by its group
    ARG_ADMIT_GRACE_MS  how long an admitted task may take to start

  A script decides each message with `admitOne` (ADMITTED, HELD_RATE or
  HELD_GROUP), or first asks `admittedByCount` whether it is admitted
  without a look at its task, then calls `admissionDone` once, which
  writes the rate window's count. Task hashes and group sets are built from the prefixes;
  they share the queue's hash tag, so they are in the script's slot.
]]
local ARG_GROUP = 1
local ARG_NOW = 2
local ARG_RATE_LIMIT = 3
local ARG_RATE_PER_MS = 4
local ARG_GROUP_LIMIT = 5
local ARG_GROUP_PREFIX = 6
local ARG_TASK_PREFIX = 7
local ARG_GROUP_RETRY_MS = 8
local ARG_ADMIT_GRACE_MS = 9

local ADMITTED, HELD_RATE, HELD_GROUP = 1, 2, 3

local streamKey, delayedKey, rateKey = KEYS[1], KEYS[2], KEYS[3]
local group, now = ARGV[ARG_GROUP], ARGV[ARG_NOW]
local rateLimit, perMs = tonumber(ARGV[ARG_RATE_LIMIT]), tonumber(ARGV[ARG_RATE_PER_MS])
local groupLimit, groupPrefix = tonumber(ARGV[ARG_GROUP_LIMIT]), ARGV[ARG_GROUP_PREFIX]
local taskPrefix = ARGV[ARG_TASK_PREFIX]
local groupRetryMs = tonumber(ARGV[ARG_GROUP_RETRY_MS])
local graceMs = tonumber(ARGV[ARG_ADMIT_GRACE_MS])
local clock = redisTimeMs()

-- The rate window: its number, the starts counted in it, and when the
-- next begins.
local window, started, nextWindow = 0, 0, 0
if rateLimit > 0 then
  window = math.floor(clock / perMs)
  nextWindow = (window + 1) * perMs
  local w = redis.call("HMGET", rateKey, "w", "n")
  if tonumber(w[1]) == window then
    started = tonumber(w[2]) or 0
  end
end
local counted = started

-- Whether a member of a group set still holds its slot.
local function holdsSlot(member, admittedAt)
  local status = redis.call("HGET", taskPrefix .. member, "status")
  if status == "RUNNING" then
    return true
  end
  return status == "QUEUED" and clock - tonumber(admittedAt) < graceMs
end

-- Take a slot of `name` for `taskId`, if one is free.
local function takeSlot(name, taskId)
  local setKey = groupPrefix .. name
  if redis.call("ZSCORE", setKey, taskId) then
    return true
  end
  local members = redis.call("ZRANGE", setKey, 0, -1, "WITHSCORES")
  local holding = 0
  for j = 1, #members, 2 do
    if holdsSlot(members[j], members[j + 1]) then
      holding = holding + 1
    else
      redis.call("ZREM", setKey, members[j])
    end
  end
  if holding >= groupLimit then
    return false
  end
  redis.call("ZADD", setKey, clock, taskId)
  return true
end

local function hold(taskKey, taskId, msgId, by, untilMs, count)
  redis.call("XACK", streamKey, group, msgId)
  redis.call("XDEL", streamKey, msgId)
  redis.call("HSET", taskKey, "status", "SCHEDULED", "held_by", by, "held_until", untilMs,
    "held_count", count, "updated_at", now)
  redis.call("ZADD", delayedKey, untilMs, taskId)
end

-- Under a rate limit alone, a message within the window's count is
-- admitted without reading its task, or even naming it: a batch costs the
-- window's read and write, not a read per task. Whether the next message
-- is, counting it if so.
local function admittedByCount()
  if groupLimit == 0 and counted < rateLimit then
    counted = counted + 1
    return true
  end
  return false
end

-- Under a rate limit alone: past the window's count, the task is read, to
-- hold it if it waits (QUEUED).
local function admitByRate(taskKey, taskId, msgId)
  if admittedByCount() then
    return ADMITTED
  end
  local f = redis.pcall("HMGET", taskKey, "status", "held_count")
  if f.err or f[1] ~= "QUEUED" then
    return ADMITTED
  end
  hold(taskKey, taskId, msgId, "rate", nextWindow, (tonumber(f[2]) or 0) + 1)
  return HELD_RATE
end

-- Under a group limit (and a rate limit, if any).
local function admitByGroup(taskKey, taskId, msgId)
  local f = redis.pcall("HMGET", taskKey, "status", "group", "held_by", "held_count")
  if f.err or f[1] ~= "QUEUED" then
    return ADMITTED
  end
  local name, holds = f[2], tonumber(f[4]) or 0
  local slotted = false
  if name and name ~= "" then
    if not takeSlot(name, taskId) then
      local delay = groupRetryMs * 2 ^ math.min(holds, 4)
      hold(taskKey, taskId, msgId, "group", clock + delay, holds + 1)
      return HELD_GROUP
    end
    slotted = true
  end
  if rateLimit > 0 then
    if counted >= rateLimit then
      if slotted then
        redis.call("ZREM", groupPrefix .. name, taskId)
      end
      hold(taskKey, taskId, msgId, "rate", nextWindow, holds + 1)
      return HELD_RATE
    end
    counted = counted + 1
  end
  if f[3] then
    redis.call("HDEL", taskKey, "held_by", "held_until", "held_count")
  end
  return ADMITTED
end

-- Admit the message `msgId` of task `taskId` (hash `taskKey`), or hold it.
local function admitOne(taskKey, taskId, msgId)
  if groupLimit > 0 then
    return admitByGroup(taskKey, taskId, msgId)
  end
  return admitByRate(taskKey, taskId, msgId)
end

-- Once every message is decided: the rate window's count, if it grew.
local function admissionDone()
  if counted > started then
    redis.call("HSET", rateKey, "w", window, "n", counted)
    redis.call("PEXPIRE", rateKey, perMs * 2)
  end
end
