--[[
  Abort an idempotent operation: release its claim, if the caller still owns
  it and it is not done, so that a retry may run the operation. Its staged
  writes were never sent, so there is nothing to undo.

  Input:
    KEYS[1] the claim   dtq:claim:{<namespace>}:<key>
    ARGV[1] owner token

  Output: 1 released; 0 not this owner's running claim (nothing changed)
]]
local c = redis.call("HMGET", KEYS[1], "state", "owner")
if c[1] == "running" and c[2] == ARGV[1] then
  redis.call("DEL", KEYS[1])
  return 1
end
return 0
