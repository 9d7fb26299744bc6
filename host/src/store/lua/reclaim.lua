--[[
  Reclaim, for a worker, the pending messages of one queue that no live
  worker is running: those of dead workers, and its own that it left idle.

  1. The queue's liveness clock ticks (include/liveness.lua).
  2. The caller's own messages idle longer than the visibility timeout
     (XPENDING with IDLE, the caller's entries only): ones it is still
     running (its heartbeats failed for a while) or never started (its
     `start` failed). They are claimed again (their idle time reset) and
     returned apart: the caller runs those it does not hold and leaves the
     others alone.
  3. Once the clock has run a whole visibility timeout since it last
     resumed (before that, live workers may not have beaten since an
     outage, and nobody counts as dead), every other consumer of the group
     (XINFO CONSUMERS) that has not beaten within the visibility timeout (no
     stamp in the workers set, or an older one) is dead. Its messages idle
     longer than the visibility timeout (XPENDING with IDLE: a live
     worker's heartbeat resets the idle time of every message it runs, so
     this is a pre-filter only) are claimed for the caller. A dead consumer
     with nothing pending is deleted from the group, so that the consumers
     of workers that came and went do not pile up; and stamps older than the
     visibility timeout are pruned from the workers set (no stamp means
     dead, as an old one does).

  4. Each message claimed from a dead worker whose task hash still names
     that worker and that message, RUNNING, was that worker's attempt: it
     is lost. It is archived (include/attempts.lua) as outcome "lost",
     from the hash's `started_at` to now (Redis's clock: when it was found
     lost, not when the worker died), with no log (the worker died with
     it) and no digest; "-" is appended to the task's `digests`. The next
     attempt (or, with none left, the dead-lettering) then finds it
     counted. The caller's own messages are not archived: it may still be
     running them. A message that carries its task (ingest.lua) whose hash
     is still QUEUED with attempts 0 was delivered to the dead worker for
     its first attempt, which no `start` wrote: it counts as that worker's
     attempt 1 (RUNNING, then lost as above), whether or not the handler
     began before the worker died.

  Input:
    KEYS[1] ready stream   dtq:stream:{q}
    KEYS[2] workers set    dtq:workers:{q}   consumer -> last beat (ms, Redis's clock)
    KEYS[3] clock hash     dtq:clock:{q}     last, resumed (ms, Redis's clock)

    ARGV by name (the ARG_ locals below; store/reclaim.rs, RECLAIM_ARGV):
    ARG_GROUP        consumer group
    ARG_CONSUMER     consumer (worker) name: the caller
    ARG_VISIBILITY   visibility timeout (ms)
    ARG_LIMIT        most messages to claim
    ARG_TASK_PREFIX  prefix of task hashes of this queue, dtq:task:{q}:

  Reads and writes keys not in KEYS: the task hash of each message claimed
  from a dead worker, the task prefix .. task id (its id is only known once
  claimed). They share the queue's hash tag, so they live in the same
  cluster slot as every other key here.

  Output: {dead, own}, each an XCLAIM reply, a list of entries
  {id, {field, value, ...}}:
    dead   messages of dead workers, now pending on the caller
    own    the caller's own messages of step 2
  together at most ARG_LIMIT entries. XCLAIM drops entries deleted from the
  stream from the pending list and does not return them (Redis 7).

  Errors: NOGROUP when the stream or its group does not exist.
]]
local ARG_GROUP = 1
local ARG_CONSUMER = 2
local ARG_VISIBILITY = 3
local ARG_LIMIT = 4
local ARG_TASK_PREFIX = 5

local streamKey, workersKey, clockKey = KEYS[1], KEYS[2], KEYS[3]
local group, consumer, taskPrefix = ARGV[ARG_GROUP], ARGV[ARG_CONSUMER], ARGV[ARG_TASK_PREFIX]
local visibility, limit = tonumber(ARGV[ARG_VISIBILITY]), tonumber(ARGV[ARG_LIMIT])

local now = redisTimeMs()
local settled = now - tickClock(clockKey, now, visibility) >= visibility
local oldestLive = now - visibility

-- How long each message found idle had been (ms), by message id.
local idleFor = {}

-- The ids of `owner`'s messages idle longer than the visibility timeout,
-- at most `count`, appended to `ids`.
local function idle(owner, count, ids)
  if count <= 0 then
    return
  end
  local entries = redis.call("XPENDING", streamKey, group, "IDLE", visibility, "-", "+", count, owner)
  for _, e in ipairs(entries) do
    ids[#ids + 1] = e[1]
    idleFor[e[1]] = e[3]
  end
end

local function claim(ids)
  if #ids == 0 then
    return {}
  end
  return redis.call("XCLAIM", streamKey, group, consumer, visibility, unpack(ids))
end

-- Step 4: archive the lost attempt of each entry claimed from a dead
-- worker; `owners` maps message id to the consumer it was claimed from.
local function archiveLost(entries, owners)
  for _, e in ipairs(entries) do
    -- Any field but `id` means the message carries its task.
    local msgId, body, carries = e[1], e[2] or {}, false
    local taskId = messageTaskId(body)
    for i = 1, #body, 2 do
      carries = carries or body[i] ~= "id"
    end
    if taskId then
      local taskKey = taskPrefix .. taskId
      -- pcall: a task key of another type would fail the whole reclaim,
      -- every time; its message is left to start.lua, which fails it.
      local f = redis.pcall("HMGET", taskKey, "status", "worker", "msg_id", "attempts",
        "max_attempts", "started_at", "digests", "expires_at")
      if f.err then
        f = {}
      end
      if carriedFirst(f[1], f[4], f[3], msgId) and not f[8] and carries then
        -- A carried first attempt (ingest.lua) its worker never beat for
        -- (heartbeat.lua writes the attempt at its first beat): written
        -- now as start would have, started when the message was
        -- delivered, which is when it was last idle from.
        local began = string.format("%d", now - (idleFor[msgId] or 0))
        f[1], f[2], f[4], f[6] = "RUNNING", owners[msgId], "1", began
        redis.call("HSET", taskKey, "status", "RUNNING", "attempts", "1",
          "worker", owners[msgId], "started_at", began, "updated_at", string.format("%d", now))
      end
      if f[1] == "RUNNING" and f[2] == owners[msgId] and f[3] == msgId then
        local n = tonumber(f[4] or "0")
        archiveAttempt(taskKey, n, "lost",
          "worker lost during attempt " .. n .. " of " .. (f[5] or "1") ..
          ": it stopped beating, and the attempt left no log", false, f[6], now, false)
        redis.call("HSET", taskKey, "digests", f[7] and (f[7] .. ",-") or "-")
      end
    end
  end
end

local own, dead, owners = {}, {}, {}
idle(consumer, limit, own)

if settled then
  for _, c in ipairs(redis.call("XINFO", "CONSUMERS", streamKey, group)) do
    local name, pending
    for i = 1, #c, 2 do
      if c[i] == "name" then
        name = c[i + 1]
      elseif c[i] == "pending" then
        pending = c[i + 1]
      end
    end
    if name ~= consumer then
      local beat = redis.call("ZSCORE", workersKey, name)
      if not (beat and tonumber(beat) > oldestLive) then
        if pending == 0 then
          redis.call("XGROUP", "DELCONSUMER", streamKey, group, name)
        else
          local from = #dead
          idle(name, limit - #own - #dead, dead)
          for i = from + 1, #dead do
            owners[dead[i]] = name
          end
        end
      end
    end
  end
  redis.call("ZREMRANGEBYSCORE", workersKey, "-inf", "(" .. string.format("%d", oldestLive))
end
local claimed = claim(dead)
archiveLost(claimed, owners)
return { claimed, claim(own) }
