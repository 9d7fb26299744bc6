--[[
  Purge dead-lettered tasks of one queue: a chunk of them (the host sends
  at most DLQ_CHUNK ids per call), each atomically, for the admin route
  (DELETE /v1/queues/{q}/dlq) and the workers' retention sweep alike.

  For each id that is in the dead-letter set (dead-lettered no later than
  ARGV[4], when given; and while the set holds more than ARGV[3] entries,
  when given: so that two sweeps trimming to a count at once never purge
  more than the excess):
    1. it leaves the set;
    2. its task hash is deleted (if the task is dead-lettered; a hash of
       another status is left alone, as a dangling entry's);
    3. its idempotency record is deleted if it still names this task, so
       its key can be submitted afresh as a new task (a record that names
       another task, after the key was re-acquired, is left alone);
    4. a PURGED event is appended, so live views drop the task.
  An id not in the set is skipped: only dead-lettered tasks are purged here.

  Input:
    KEYS[1] dead-letter set   dtq:dlq:{q}
    KEYS[2] events stream     dtq:events:{q}
    then, per task i (from 0):
    KEYS[3 + 2i] task hash            dtq:task:{q}:<id>
    KEYS[4 + 2i] idempotency record   dtq:idempotency:{q}:<key> (ignored unless it has a key)

    ARGV[1] now (ms since epoch)
    ARGV[2] events stream max length
    ARGV[3] entries to keep at least ("": no floor)
    ARGV[4] latest dead-letter time (ms, the set's score) to purge ("": any)
    then, per task i, 2 values from ARGV[5 + 2i]:
      task id; "1" when the task has an idempotency key

  Output: the number of ids removed from the dead-letter set.

  Events: PURGED for each (an event, not a task status: the task is gone).
]]
local dlqKey, eventsKey = KEYS[1], KEYS[2]
local now, eventsMaxLen = ARGV[1], ARGV[2]
local floor, latest = tonumber(ARGV[3]), tonumber(ARGV[4])

local purged = 0
for i = 0, (#KEYS - 2) / 2 - 1 do
  local taskKey, idemKey = KEYS[3 + 2 * i], KEYS[4 + 2 * i]
  local taskId, hasKey = ARGV[5 + 2 * i], ARGV[6 + 2 * i] == "1"
  if floor and redis.call("ZCARD", dlqKey) <= floor then
    break
  end
  local score = redis.call("ZSCORE", dlqKey, taskId)
  if score and not (latest and tonumber(score) > latest) then
    redis.call("ZREM", dlqKey, taskId)
    local f = redis.call("HMGET", taskKey, "status", "attempts")
    if f[1] == "DEAD_LETTERED" then
      redis.call("DEL", taskKey)
    end
    if hasKey then
      local raw = redis.call("GET", idemKey)
      if raw and cjson.decode(raw)["task_id"] == taskId then
        redis.call("DEL", idemKey)
      end
    end
    addEvent(eventsKey, eventsMaxLen, taskId, "PURGED", f[2] or "0", now)
    purged = purged + 1
  end
end
return purged
