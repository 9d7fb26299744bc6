--[[
  Record in a parent's flow what became of one of its staged submissions
  or children (see include/flow.lua), and resume the parent if that
  settled its flow while it waits. Every step is idempotent: the applier
  and the sweeper may record the same thing twice.

  Input:
    KEYS[1] parent task hash   dtq:task:{q}:<id>
    KEYS[2] parent's flow      dtq:flow:{q}:<id>
    KEYS[3] ready stream       dtq:stream:{q}
    KEYS[4] events stream      dtq:events:{q}
    KEYS[5] flows index        dtq:flows:{q}
    KEYS[6] waiting set        dtq:waiting:{q}

    ARGV by name (the ARG_ locals below; store/flow.rs, FLOW_RECORD_ARGV):
    ARG_TASK_ID         the parent's id
    ARG_EID             the staged submission that was applied ("" for
                        none): it leaves the outbox
    ARG_CHILD           the child, "<queue>/<id>" ("" for none): recorded
                        among the children when ARG_EID is set (at the
                        position its record gets)
    ARG_TERMINAL        "1" when that child is terminal
    ARG_REFUSAL         why the child's submission was refused ("" when it
                        was not): kept as `r:<child>`, the child counted
                        as ended (it never runs)
    ARG_NOW             now (ms since epoch)
    ARG_EVENTS_MAX_LEN  events stream max length

  Output: 1 when the parent was resumed here, else 0.

  Events: QUEUED when the parent resumes.
]]
local ARG_TASK_ID = 1
local ARG_EID = 2
local ARG_CHILD = 3
local ARG_TERMINAL = 4
local ARG_REFUSAL = 5
local ARG_NOW = 6
local ARG_EVENTS_MAX_LEN = 7

local taskKey, flowKey, streamKey, eventsKey, flowsKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local waitingKey = KEYS[6]
local taskId, eid, child = ARGV[ARG_TASK_ID], ARGV[ARG_EID], ARGV[ARG_CHILD]
local now, eventsMaxLen = ARGV[ARG_NOW], ARGV[ARG_EVENTS_MAX_LEN]

-- A parent gone with its flow (expired after its retention): nothing to
-- record into, and nothing is made for it.
if redis.call("EXISTS", flowKey) == 0 and redis.call("EXISTS", taskKey) == 0 then
  return 0
end
if eid ~= "" and redis.call("HDEL", flowKey, "s:" .. eid) == 1 then
  redis.call("HINCRBY", flowKey, "staged", -1)
end
if child ~= "" then
  if eid ~= "" and redis.call("HEXISTS", flowKey, "c:" .. child) == 0 then
    redis.call("HSET", flowKey, "c:" .. child, redis.call("HINCRBY", flowKey, "seq", 1))
    redis.call("HINCRBY", flowKey, "children", 1)
  end
  if ARGV[ARG_REFUSAL] ~= "" then
    redis.call("HSET", flowKey, "r:" .. child, ARGV[ARG_REFUSAL])
  end
  if ARGV[ARG_TERMINAL] == "1" and redis.call("HSETNX", flowKey, "d:" .. child, now) == 1 then
    redis.call("HINCRBY", flowKey, "settled", 1)
  end
end
local resumed = resumeIfSettled(taskKey, flowKey, streamKey, waitingKey, taskId, now)
if resumed then
  addEvent(eventsKey, eventsMaxLen, taskId, "QUEUED", resumed, now)
  -- Its sweep looks may have backed off while it waited: the next comes
  -- soon, and finds it ended, and takes it out of the index.
  redis.call("ZADD", flowsKey, "XX", now, taskId)
end
flowQuiet(taskKey, flowKey, flowsKey, taskId)
return resumed and 1 or 0
