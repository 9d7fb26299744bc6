--[[
  Renew the lease of a running claim, while its owner's call runs.

  Input:
    KEYS[1] the claim   dtq:claim:{<namespace>}:<key>

    ARGV by name (the ARG_ locals below; sandbox/operation.rs, RENEW_ARGV):
    ARG_TOKEN  owner token
    ARG_LEASE  lease (ms), from now on Redis's clock

  Output: 1 renewed; 0 not this owner's running claim (taken over, done,
  expired): the caller stops renewing
]]
local ARG_TOKEN = 1
local ARG_LEASE = 2

local c = redis.call("HMGET", KEYS[1], "state", "owner")
if c[1] ~= "running" or c[2] ~= ARGV[ARG_TOKEN] then
  return 0
end
redis.call("HSET", KEYS[1], "lease_until", redisTimeMs() + tonumber(ARGV[ARG_LEASE]))
return 1
