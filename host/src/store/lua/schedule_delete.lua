--[[
  Delete a periodic task's schedule: its definition, its next tick and its
  last fired tick, together. No tick of it fires after this; a scheduler
  that read its tick already may still fire that one tick (its task is
  submitted before the advance), and its advance then finds no tick to
  move and writes nothing, so the schedule does not come back.

  Input:
    KEYS[1] schedules    dtq:schedules:{q}
    KEYS[2] due set      dtq:schedule-due:{q}
    KEYS[3] fired        dtq:schedule-fired:{q}

    ARGV by name (the ARG_ locals below; store/schedules.rs,
    SCHEDULE_DELETE_ARGV):
    ARG_NAME  schedule name

  Output: 1 when the schedule was deleted, 0 when there was none.
]]
local schedulesKey, dueKey, firedKey = KEYS[1], KEYS[2], KEYS[3]
local ARG_NAME = 1

local name = ARGV[ARG_NAME]

local deleted = redis.call("HDEL", schedulesKey, name)
redis.call("ZREM", dueKey, name)
redis.call("HDEL", firedKey, name)
return deleted
