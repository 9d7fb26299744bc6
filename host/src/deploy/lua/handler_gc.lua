--[[
  Delete the modules no history entry references any more.

  Input:
    KEYS[1] module refs   dtq:module-refs:{registry}
    KEYS[2..] modules     dtq:module:{registry}:<digest>, one per digest

    ARGV by name (the ARG_ locals below; deploy/registry.rs, GC_ARGV):
    from ARG_DIGESTS, the modules' digests, in the same order

  Output: how many modules were deleted. A digest referenced again since it
  was found orphaned (deployed anew) keeps its module.
]]
local ARG_DIGESTS = 1

local deleted = 0
for i = ARG_DIGESTS, #ARGV do
  if redis.call("HEXISTS", KEYS[1], ARGV[i]) == 0 then
    deleted = deleted + redis.call("DEL", KEYS[2 + i - ARG_DIGESTS])
  end
end
return deleted
