--[[
  Record what one process runs, stamped with Redis's clock, and forget the
  processes that stopped reporting.

  Input:
    KEYS[1] fleet   dtq:fleet:{registry} (hash: process id -> "<ms> <report JSON>")

    ARGV[1] process id
    ARGV[2] report JSON, or "" to remove the process (it is stopping)
    ARGV[3] forget reports older than this (ms)

  Output: now (ms, Redis's clock).
]]
local fleetKey, id, report, forgetMs = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = redisTimeMs()

if report == "" then
  redis.call("HDEL", fleetKey, id)
else
  redis.call("HSET", fleetKey, id, string.format("%d", now) .. " " .. report)
end
local all = redis.call("HGETALL", fleetKey)
for i = 1, #all, 2 do
  local seen = tonumber(string.match(all[i + 1], "^(%d+) "))
  if not seen or now - seen > forgetMs then
    redis.call("HDEL", fleetKey, all[i])
  end
end
return now
