--[[
  Deploy a module as the active version of a task.

  Input:
    KEYS[1] active versions  dtq:handlers:{registry}   (hash: task -> entry)
    KEYS[2] task's history   dtq:history:{registry}:<task>  (list, newest first)
    KEYS[3] the module       dtq:module:{registry}:<digest>
    KEYS[4] module refs      dtq:module-refs:{registry} (hash: digest -> entries)
    KEYS[5] revision         dtq:revision:{registry}

    ARGV[1] task name
    ARGV[2] module digest (SHA-256, hex)
    ARGV[3] fingerprint of digest and settings
    ARGV[4] the new entry, "deploy <at> <version JSON>"
    ARGV[5] the module's bytes, or "" when the caller saw it stored already
    ARGV[6] history bound (entries kept per task)
    ARGV[7] pub/sub channel of registry changes
    ARGV[8] publish command: "PUBLISH", or "SPUBLISH" on a cluster

  Output:
    {1, previous entry or false, orphan digests...}
                DEPLOYED: the entry is active and first in the history
    {2, active entry}
                UNCHANGED: the same module with the same settings is active;
                nothing written
    {3}         NEED_MODULE: ARGV[5] was "" but the module is not stored;
                nothing written (call again with the bytes)

  The module is written once (SET NX) and kept while an entry of any task
  references it; the caller deletes the orphans' modules with handler_gc.
]]
local activeKey, historyKey, moduleKey, refsKey, revisionKey =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local task, digest, fingerprint, entry, module, bound, channel, publish =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[7], ARGV[8]

local previous = redis.call("HGET", activeKey, task)
if previous and versionOf(previous).fingerprint == fingerprint then
  return { 2, previous }
end
if module == "" then
  if redis.call("EXISTS", moduleKey) == 0 then
    return { 3 }
  end
else
  redis.call("SET", moduleKey, module, "NX")
end

redis.call("HSET", activeKey, task, entry)
local orphans = pushHistory(historyKey, refsKey, entry, digest, bound)
announce(revisionKey, channel, publish)
local out = { 1, previous or false }
for _, d in ipairs(orphans) do
  out[#out + 1] = d
end
return out
