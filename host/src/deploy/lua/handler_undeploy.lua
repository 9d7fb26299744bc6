--[[
  Remove a task's active version: workers unload it, and the API refuses new
  submissions of the task. Its history is kept, so a rollback can bring it
  back.

  Input:
    KEYS[1] active versions  dtq:handlers:{registry}
    KEYS[2] task's history   dtq:history:{registry}:<task>
    KEYS[3] module refs      dtq:module-refs:{registry}
    KEYS[4] revision         dtq:revision:{registry}

    ARGV[1] task name
    ARGV[2] now (ms since epoch)
    ARGV[3] history bound
    ARGV[4] pub/sub channel of registry changes
    ARGV[5] publish command: "PUBLISH", or "SPUBLISH" on a cluster

  Output:
    {1, orphan digests...}  UNDEPLOYED
    {0}                     NOT_ACTIVE: already undeployed; nothing written
    {-21}                   NO_HISTORY: the task was never deployed
]]
local activeKey, historyKey, refsKey, revisionKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local task, now, bound, channel, publish = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]

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
