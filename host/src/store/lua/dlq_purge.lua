--[[
  Purge dead-lettered tasks of one queue: a chunk of them (the host sends
  at most DLQ_CHUNK ids per call), each atomically, for the admin route
  (DELETE /v1/queues/{q}/dlq) and the workers' retention sweep alike.

  For each id that is in the dead-letter set (dead-lettered no later than
  ARG_LATEST, when given; and while the set holds more than ARG_FLOOR
  entries, when given: so that two sweeps trimming to a count at once never
  purge more than the excess):
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
    KEYS[3 + 3i] task hash            dtq:task:{q}:<id>
    KEYS[4 + 3i] idempotency record   dtq:idempotency:{q}:<key> (ignored unless it has a key)
    KEYS[5 + 3i] its flow             dtq:flow:{q}:<id> (flows: a parent's outbox
                                      and children; deleted with the task)

    ARGV by name (the ARG_ locals below; store/dlq.rs, DLQ_PURGE_ARGV):
    ARG_NOW             now (ms since epoch)
    ARG_EVENTS_MAX_LEN  events stream max length
    ARG_FLOOR           entries to keep at least ("": no floor)
    ARG_LATEST          latest dead-letter time (ms, the set's score) to
                        purge ("": any)
    then, per task i, 2 values from ARG_TASKS + 2i:
      task id; "1" when the task has an idempotency key

  Output: the number of ids removed from the dead-letter set.

  Events: PURGED for each (an event, not a task status: the task is gone).
]]
local ARG_NOW = 1
local ARG_EVENTS_MAX_LEN = 2
local ARG_FLOOR = 3
local ARG_LATEST = 4
local ARG_TASKS = 5

local dlqKey, eventsKey = KEYS[1], KEYS[2]
local now, eventsMaxLen = ARGV[ARG_NOW], ARGV[ARG_EVENTS_MAX_LEN]
local floor, latest = tonumber(ARGV[ARG_FLOOR]), tonumber(ARGV[ARG_LATEST])

local purged = 0
for i = 0, (#KEYS - 2) / 3 - 1 do
  local taskKey, idemKey, flowKey = KEYS[3 + 3 * i], KEYS[4 + 3 * i], KEYS[5 + 3 * i]
  local a = ARG_TASKS + 2 * i
  local taskId, hasKey = ARGV[a], ARGV[a + 1] == "1"
  if floor and redis.call("ZCARD", dlqKey) <= floor then
    break
  end
  local score = redis.call("ZSCORE", dlqKey, taskId)
  if score and not (latest and tonumber(score) > latest) then
    redis.call("ZREM", dlqKey, taskId)
    local f = redis.call("HMGET", taskKey, "status", "attempts")
    if f[1] == "DEAD_LETTERED" then
      redis.call("DEL", taskKey, flowKey)
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
