--[[
  Move due tasks from the delayed set to the ready stream.

  The caller reads the due ids first (ZRANGE ... BYSCORE) and passes their
  hashes in KEYS. ZREM decides who moves each task: of several workers
  promoting at once, exactly one removes it and enqueues it, so no task is
  lost (it stays in the set until enqueued, atomically) or duplicated.

  Input:
    KEYS[1] delayed set    dtq:delayed:{q}
    KEYS[2] ready stream   dtq:stream:{q}
    KEYS[3] events stream  dtq:events:{q}
    KEYS[4..] the task hash of each id from ARG_TASK_IDS on, in order

    ARGV by name (the ARG_ locals below; store/promote.rs, PROMOTE_ARGV):
    ARG_NOW             now (ms since epoch)
    ARG_EVENTS_MAX_LEN  events stream max length
    then from ARG_TASK_IDS, the task ids

  Output: the number of tasks moved.

  Events: QUEUED for each task moved.
]]
local ARG_NOW = 1
local ARG_EVENTS_MAX_LEN = 2
local ARG_TASK_IDS = 3

local delayedKey, streamKey, eventsKey = KEYS[1], KEYS[2], KEYS[3]
local now, eventsMaxLen = tonumber(ARGV[ARG_NOW]), ARGV[ARG_EVENTS_MAX_LEN]
local moved = 0
for i = 4, #KEYS do
  local taskKey, taskId = KEYS[i], ARGV[ARG_TASK_IDS + i - 4]
  local due = redis.call("ZSCORE", delayedKey, taskId)
  if due and tonumber(due) <= now and redis.call("ZREM", delayedKey, taskId) == 1 then
    local f = redis.call("HMGET", taskKey, "status", "attempts")
    if f[1] == "SCHEDULED" or f[1] == "RETRYING" then
      redis.call("HSET", taskKey, "status", "QUEUED", "updated_at", now)
      redis.call("XADD", streamKey, "*", "id", taskId)
      addEvent(eventsKey, eventsMaxLen, taskId, "QUEUED", f[2] or "0", now)
      moved = moved + 1
    end
  end
end
return moved
