--[[
  Raise a queue's partition count as one partition's slot knows it; never
  lower it. The host calls this on every partition, partition 0 last (see
  store/partitions.rs), so that a submitter that read the new count from
  partition 0 finds it in every slot it routes to.

  Input:
    KEYS[1] partition count    dtq:partitions:{q#i}
    KEYS[2] partition history  dtq:partition-history:{q#i} (written only with ARG_KEEPS_HISTORY)

    ARGV by name (the ARG_ locals below; store/partitions.rs,
    PARTITIONS_RAISE_ARGV):
    ARG_COUNT          the new count
    ARG_KEEPS_HISTORY  "1" for partition 0, which keeps the history of
                       replaced counts
    ARG_LIVE_UNTIL     until when (ms) keyed records routed by the replaced
                       count may still live: now plus the idempotency TTL
    ARG_NOW            now (ms since epoch): history entries that ended
                       are dropped

  Output: the count in force after the call (a larger concurrent raise
  wins; a smaller or equal one changes nothing).
]]
local ARG_COUNT = 1
local ARG_KEEPS_HISTORY = 2
local ARG_LIVE_UNTIL = 3
local ARG_NOW = 4

local current = tonumber(redis.call("GET", KEYS[1]) or "1")
local count = tonumber(ARGV[ARG_COUNT])
if count <= current then
  return current
end
redis.call("SET", KEYS[1], count)
if ARGV[ARG_KEEPS_HISTORY] == "1" then
  redis.call("ZADD", KEYS[2], ARGV[ARG_LIVE_UNTIL], current)
  redis.call("ZREMRANGEBYSCORE", KEYS[2], "-inf", "(" .. ARGV[ARG_NOW])
end
return count
