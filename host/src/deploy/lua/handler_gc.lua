--[[
  Delete the modules no history entry references any more.

  Input:
    KEYS[1] module refs   dtq:module-refs:{registry}
    KEYS[2..] modules     dtq:module:{registry}:<digest>, one per ARGV digest

    ARGV[1..] their digests, in the same order

  Output: how many modules were deleted. A digest referenced again since it
  was found orphaned (deployed anew) keeps its module.
]]
local deleted = 0
for i, digest in ipairs(ARGV) do
  if redis.call("HEXISTS", KEYS[1], digest) == 0 then
    deleted = deleted + redis.call("DEL", KEYS[i + 1])
  end
end
return deleted
