--[[
  Make an earlier version of a task active again.

  Input:
    KEYS[1] active versions  dtq:handlers:{registry}
    KEYS[2] task's history   dtq:history:{registry}:<task>
    KEYS[3] module refs      dtq:module-refs:{registry}
    KEYS[4] revision         dtq:revision:{registry}

    ARGV by name (the ARG_ locals below; deploy/registry.rs,
    ROLLBACK_ARGV):
    ARG_TASK     task name
    ARG_TO       digest to return to, or "" for the newest version in the
                 history that differs from the active one (module or
                 settings)
    ARG_NOW      now (ms since epoch)
    ARG_BOUND    history bound
    ARG_CHANNEL  pub/sub channel of registry changes
    ARG_PUBLISH  publish command: "PUBLISH", or "SPUBLISH" on a cluster

  Output:
    {1, the new active entry, orphan digests...}
                ROLLED_BACK: "rollback <now> <version JSON>" of the version
                returned to, active and first in the history
    {-21}       NO_HISTORY: the task was never deployed
    {-22}       NOT_IN_HISTORY: no entry of the task has that digest
    {-23}       NO_EARLIER: every version in the history is the active one

  A version in the history still has its module: the history references it.
]]
local activeKey, historyKey, refsKey, revisionKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ARG_TASK = 1
local ARG_TO = 2
local ARG_NOW = 3
local ARG_BOUND = 4
local ARG_CHANNEL = 5
local ARG_PUBLISH = 6

local task, to, now = ARGV[ARG_TASK], ARGV[ARG_TO], ARGV[ARG_NOW]
local bound, channel, publish = tonumber(ARGV[ARG_BOUND]), ARGV[ARG_CHANNEL], ARGV[ARG_PUBLISH]

local entries = redis.call("LRANGE", historyKey, 0, -1)
if #entries == 0 then
  return { -21 }
end
local active = redis.call("HGET", activeKey, task)
local current = active and versionOf(active).fingerprint

local target
for _, entry in ipairs(entries) do
  local version = versionOf(entry)
  if type(version.digest) == "string" then
    if to ~= "" then
      if version.digest == to then
        target = entry
        break
      end
    elseif version.fingerprint ~= current then
      target = entry
      break
    end
  end
end
if not target then
  return { to ~= "" and -22 or -23 }
end

local version = versionOf(target)
local entry = "rollback " .. now .. " " .. versionText(target)
redis.call("HSET", activeKey, task, entry)
local orphans = pushHistory(historyKey, refsKey, entry, version.digest, bound)
announce(revisionKey, channel, publish)
local out = { 1, entry }
for _, d in ipairs(orphans) do
  out[#out + 1] = d
end
return out
