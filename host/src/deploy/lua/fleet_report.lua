--[[
  Record what one process runs, stamped with Redis's clock, and forget the
  processes that stopped reporting.

  Input:
    KEYS[1] fleet   dtq:fleet:{registry} (hash: process id -> "<ms> <report JSON>")

    ARGV by name (the ARG_ locals below; deploy/registry.rs, REPORT_ARGV):
    ARG_ID         process id
    ARG_REPORT     report JSON, or "" to remove the process (it is stopping)
    ARG_FORGET_MS  forget reports older than this (ms)

  Output: now (ms, Redis's clock).
]]
local ARG_ID = 1
local ARG_REPORT = 2
local ARG_FORGET_MS = 3

local fleetKey = KEYS[1]
local id, report, forgetMs = ARGV[ARG_ID], ARGV[ARG_REPORT], tonumber(ARGV[ARG_FORGET_MS])
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
