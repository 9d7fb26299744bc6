--[[
  Stage submissions of an idempotent operation into a task's flow (its
  outbox, see include/flow.lua) before the operation commits: each names
  the operation's claim and owner, and applies only once that claim is
  known to be committed by that owner (ingest/flow.rs); until then the
  flow counts it as staged, so a waiting task is not resumed before it is
  settled.

  Input:
    KEYS[1] the task's flow  dtq:flow:{q}:<id>
    KEYS[2] flows index      dtq:flows:{q}

    ARGV by name (the ARG_ locals below; store/flow.rs, FLOW_STAGE_ARGV):
    ARG_TASK_ID   the task's id
    ARG_NOW       now (ms since epoch)
    then, from ARG_ENTRIES, each staged submission (JSON)

  Output: the number of submissions staged.
]]
local ARG_TASK_ID = 1
local ARG_NOW = 2
local ARG_ENTRIES = 3

local flowKey, flowsKey = KEYS[1], KEYS[2]
local n = 0
for i = ARG_ENTRIES, #ARGV do
  local eid = redis.call("HINCRBY", flowKey, "seq", 1)
  redis.call("HSET", flowKey, "s:" .. eid, ARGV[i])
  n = n + 1
end
if n > 0 then
  redis.call("HINCRBY", flowKey, "staged", n)
  redis.call("PERSIST", flowKey)
  redis.call("ZADD", flowsKey, ARGV[ARG_NOW], ARGV[ARG_TASK_ID])
end
return n
