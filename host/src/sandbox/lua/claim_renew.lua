--[[
  Renew the lease of a running claim, while its owner's call runs.

  Input:
    KEYS[1] the claim   dtq:claim:{<namespace>}:<key>
    ARGV[1] owner token
    ARGV[2] lease (ms), from now on Redis's clock

  Output: 1 renewed; 0 not this owner's running claim (taken over, done,
  expired): the caller stops renewing
]]
local c = redis.call("HMGET", KEYS[1], "state", "owner")
if c[1] ~= "running" or c[2] ~= ARGV[1] then
  return 0
end
redis.call("HSET", KEYS[1], "lease_until", redisTimeMs() + tonumber(ARGV[2]))
return 1
