--[[
  Shared fragment: Redis's clock, for every script that stamps a time by
  the server rather than by its caller (heartbeat and reclaim through
  include/liveness.lua; the sandbox's claims and kv writes; the fleet
  report). One server clock for every process: no script trusts a
  worker's.
]]

-- Redis's time, in ms since the epoch.
local function redisTimeMs()
  local t = redis.call("TIME")
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
