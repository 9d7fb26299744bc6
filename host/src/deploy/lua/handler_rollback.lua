--[[
  Make an earlier version of a task active again.

  Input:
    KEYS[1] active versions  dtq:handlers:{registry}
    KEYS[2] task's history   dtq:history:{registry}:<task>
    KEYS[3] module refs      dtq:module-refs:{registry}
    KEYS[4] revision         dtq:revision:{registry}

    ARGV[1] task name
    ARGV[2] digest to return to, or "" for the newest version in the history
            that differs from the active one (module or settings)
    ARGV[3] now (ms since epoch)
    ARGV[4] history bound
    ARGV[5] pub/sub channel of registry changes
    ARGV[6] publish command: "PUBLISH", or "SPUBLISH" on a cluster

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
local task, to, now, bound, channel = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local publish = ARGV[6]

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
