--[[
  Advance a schedule past the tick a scheduler fired: a compare-and-set on
  its due time.

  Every scheduler of the queue reads the due schedules, submits each due
  tick's task with the idempotency key `schedule:<name>:<tick>`, and then
  calls this. Only the call that still finds the due time it read moves it
  (and records what was fired); the others, which raced it or fired late,
  change nothing. A scheduler that dies between its submit and this call
  leaves the due time as it was: the next one fires the same tick again,
  and the key makes that the same task.

  Input:
    KEYS[1] due set      dtq:schedule-due:{q}     name -> next tick (ms)
    KEYS[2] fired        dtq:schedule-fired:{q}   name -> last fired tick (JSON)

    ARGV by name (the ARG_ locals below; store/schedules.rs,
    SCHEDULE_ADVANCE_ARGV):
    ARG_NAME       schedule name
    ARG_READ       the due time the caller read (ms)
    ARG_NEXT_TICK  the next tick (ms), or "" when the schedule has none (it
                   stays defined and never fires)
    ARG_FIRED      what was fired (JSON, the host's), or "" to leave it

  Output: 1 when the due time moved, 0 when it was not the one read (or
  the schedule is gone).
]]
local dueKey, firedKey = KEYS[1], KEYS[2]
local ARG_NAME = 1
local ARG_READ = 2
local ARG_NEXT_TICK = 3
local ARG_FIRED = 4

local name, read = ARGV[ARG_NAME], ARGV[ARG_READ]
local nextTick, fired = ARGV[ARG_NEXT_TICK], ARGV[ARG_FIRED]

local due = redis.call("ZSCORE", dueKey, name)
if not due or tonumber(due) ~= tonumber(read) then
  return 0
end
if nextTick == "" then
  redis.call("ZREM", dueKey, name)
else
  redis.call("ZADD", dueKey, "XX", nextTick, name)
end
if fired ~= "" then
  redis.call("HSET", firedKey, name, fired)
end
return 1
