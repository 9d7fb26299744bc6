--[[
  Deploy a module as the active version of a task.

  Input:
    KEYS[1] active versions  dtq:handlers:{registry}   (hash: task -> entry)
    KEYS[2] task's history   dtq:history:{registry}:<task>  (list, newest first)
    KEYS[3] the module       dtq:module:{registry}:<digest>
    KEYS[4] module refs      dtq:module-refs:{registry} (hash: digest -> entries)
    KEYS[5] revision         dtq:revision:{registry}

    ARGV by name (the ARG_ locals below; deploy/registry.rs, DEPLOY_ARGV):
    ARG_TASK         task name
    ARG_DIGEST       module digest (SHA-256, hex)
    ARG_FINGERPRINT  fingerprint of digest and settings
    ARG_ENTRY        the new entry, "deploy <at> <version JSON>"
    ARG_MODULE       the module's bytes, or "" when the caller saw it stored
                     already
    ARG_BOUND        history bound (entries kept per task)
    ARG_CHANNEL      pub/sub channel of registry changes
    ARG_PUBLISH      publish command: "PUBLISH", or "SPUBLISH" on a cluster

  Output:
    {1, previous entry or false, orphan digests...}
                DEPLOYED: the entry is active and first in the history
    {2, active entry}
                UNCHANGED: the same module with the same settings is active;
                nothing written
    {3}         NEED_MODULE: ARG_MODULE was "" but the module is not stored;
                nothing written (call again with the bytes)

  The module is written once (SET NX) and kept while an entry of any task
  references it; the caller deletes the orphans' modules with handler_gc.
]]
local ARG_TASK = 1
local ARG_DIGEST = 2
local ARG_FINGERPRINT = 3
local ARG_ENTRY = 4
local ARG_MODULE = 5
local ARG_BOUND = 6
local ARG_CHANNEL = 7
local ARG_PUBLISH = 8

local activeKey, historyKey, moduleKey, refsKey, revisionKey =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local task, digest, fingerprint = ARGV[ARG_TASK], ARGV[ARG_DIGEST], ARGV[ARG_FINGERPRINT]
local entry, module, bound = ARGV[ARG_ENTRY], ARGV[ARG_MODULE], tonumber(ARGV[ARG_BOUND])
local channel, publish = ARGV[ARG_CHANNEL], ARGV[ARG_PUBLISH]

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
