--[[
  Abort an idempotent operation: release its claim, if the caller still owns
  it and it is not done, so that a retry may run the operation, and take it
  off the namespace's budget (include/quota.lua). Its staged writes were
  never sent, so there is nothing to undo.

  Input:
    KEYS[1] the claim   dtq:claim:{<namespace>}:<key>
    KEYS[2..4] the quota's (include/quota.lua)

    ARGV by name (the ARG_ locals below, after the quota's: ARG_KV_PREFIX,
    ARG_CLAIM_PREFIX, ARG_BUDGET; sandbox/operation.rs, ABORT_ARGV):
    ARG_TOKEN  owner token

  Output: 1 released; 0 not this owner's running claim (nothing changed)
]]
local ARG_TOKEN = 4

local claimKey = KEYS[1]
local c = redis.call("HMGET", claimKey, "state", "owner")
if c[1] == "running" and c[2] == ARGV[ARG_TOKEN] then
  redis.call("DEL", claimKey)
  dropClaim(string.sub(claimKey, #Q.claimPrefix + 1))
  return 1
end
return 0
