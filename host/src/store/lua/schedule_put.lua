--[[
  Create or replace a periodic task's schedule, with its next tick.

  The host parses the cron expression and computes the next tick (UTC)
  before calling; this writes the definition and the tick together, so a
  scheduler never sees one without the other. A replaced schedule's next
  tick is the new one: a tick of the old expression is never fired after
  this (a scheduler that read it already fires it once at most, and its
  compare-and-set advance then fails, see schedule_advance.lua). Its last
  fired tick is kept.

  Input:
    KEYS[1] schedules    dtq:schedules:{q}        name -> definition JSON
    KEYS[2] due set      dtq:schedule-due:{q}     name -> next tick (ms)

    ARGV by name (the ARG_ locals below; store/schedules.rs,
    SCHEDULE_PUT_ARGV):
    ARG_NAME        schedule name
    ARG_DEFINITION  definition (JSON, the host's; stored as it is)
    ARG_NEXT_TICK   next tick (ms since epoch)

  Output: 1 when the schedule is new, 0 when it replaced one.
]]
local ARG_NAME = 1
local ARG_DEFINITION = 2
local ARG_NEXT_TICK = 3

local schedulesKey, dueKey = KEYS[1], KEYS[2]
local name, definition, nextTick = ARGV[ARG_NAME], ARGV[ARG_DEFINITION], ARGV[ARG_NEXT_TICK]

local created = redis.call("HSET", schedulesKey, name, definition)
redis.call("ZADD", dueKey, nextTick, name)
return created
