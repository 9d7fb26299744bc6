--[[
  Shared by the handler registry's scripts (handler_deploy, handler_rollback,
  handler_undeploy).

  A history entry, and the value of a task in the active hash, is one string:
  "<action> <at> <version JSON>", action deploy | rollback | undeploy, at in
  ms since epoch. The version JSON ({digest, size, settings, fingerprint}, or
  {} for undeploy) is the host's, kept as it is: these scripts read fields
  from it and never encode it again.
]]

-- The version JSON of an entry, decoded.
local function versionOf(entry)
  local json = string.match(entry, "^%S+ %S+ (.*)$")
  return cjson.decode(json or "{}")
end

-- The version JSON of an entry, as text.
local function versionText(entry)
  return string.match(entry, "^%S+ %S+ (.*)$")
end

-- Push `entry` (referencing module `digest`, "" for none) on a history list
-- and count the reference; drop the entries past `bound` and their
-- references. Returns the digests no entry references any more: the caller
-- deletes their modules (handler_gc).
local function pushHistory(historyKey, refsKey, entry, digest, bound)
  redis.call("LPUSH", historyKey, entry)
  if digest ~= "" then
    redis.call("HINCRBY", refsKey, digest, 1)
  end
  local orphans = {}
  local dropped = redis.call("LRANGE", historyKey, bound, -1)
  if #dropped > 0 then
    redis.call("LTRIM", historyKey, 0, bound - 1)
    for _, old in ipairs(dropped) do
      local d = versionOf(old).digest
      if type(d) == "string" and redis.call("HINCRBY", refsKey, d, -1) <= 0 then
        redis.call("HDEL", refsKey, d)
        orphans[#orphans + 1] = d
      end
    end
  end
  return orphans
end

-- Count a change of the registry and tell every process. `publish` is
-- PUBLISH, or SPUBLISH on a cluster (the channel is in the registry's slot).
local function announce(revisionKey, channel, publish)
  local revision = redis.call("INCR", revisionKey)
  redis.call(publish, channel, revision)
end
