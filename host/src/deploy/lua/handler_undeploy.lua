--[[
  Remove a task's active version: workers unload it, and the API refuses new
  submissions of the task. Its history is kept, so a rollback can bring it
  back.

  Input:
    KEYS[1] active versions  dtq:handlers:{registry}
    KEYS[2] task's history   dtq:history:{registry}:<task>
    KEYS[3] module refs      dtq:module-refs:{registry}
    KEYS[4] revision         dtq:revision:{registry}

    ARGV by name (the ARG_ locals below; deploy/registry.rs,
    UNDEPLOY_ARGV):
    ARG_TASK     task name
    ARG_NOW      now (ms since epoch)
    ARG_BOUND    history bound
    ARG_CHANNEL  pub/sub channel of registry changes
    ARG_PUBLISH  publish command: "PUBLISH", or "SPUBLISH" on a cluster

  Output:
    {1, orphan digests...}  UNDEPLOYED
    {0}                     NOT_ACTIVE: already undeployed; nothing written
    {-21}                   NO_HISTORY: the task was never deployed
]]
local activeKey, historyKey, refsKey, revisionKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ARG_TASK = 1
local ARG_NOW = 2
local ARG_BOUND = 3
local ARG_CHANNEL = 4
local ARG_PUBLISH = 5

local task, now = ARGV[ARG_TASK], ARGV[ARG_NOW]
local bound, channel, publish = tonumber(ARGV[ARG_BOUND]), ARGV[ARG_CHANNEL], ARGV[ARG_PUBLISH]

if redis.call("HDEL", activeKey, task) == 0 then
  if redis.call("EXISTS", historyKey) == 0 then
    return { -21 }
  end
  return { 0 }
end
local orphans = pushHistory(historyKey, refsKey, "undeploy " .. now .. " {}", "", bound)
announce(revisionKey, channel, publish)
local out = { 1 }
for _, d in ipairs(orphans) do
  out[#out + 1] = d
end
return out
