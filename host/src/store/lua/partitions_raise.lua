--[[
  Raise a queue's partition count as one partition's slot knows it; never
  lower it. The host calls this on every partition, partition 0 last (see
  store/partitions.rs), so that a submitter that read the new count from
  partition 0 finds it in every slot it routes to.

  Input:
    KEYS[1] partition count    dtq:partitions:{q#i}
    KEYS[2] partition history  dtq:partition-history:{q#i} (written only when ARGV[2] == "1")

    ARGV[1] the new count
    ARGV[2] "1" for partition 0, which keeps the history of replaced counts
    ARGV[3] until when (ms) keyed records routed by the replaced count may
            still live: now plus the idempotency TTL
    ARGV[4] now (ms since epoch): history entries that ended are dropped

  Output: the count in force after the call (a larger concurrent raise
  wins; a smaller or equal one changes nothing).
]]
local current = tonumber(redis.call("GET", KEYS[1]) or "1")
local count = tonumber(ARGV[1])
if count <= current then
  return current
end
redis.call("SET", KEYS[1], count)
if ARGV[2] == "1" then
  redis.call("ZADD", KEYS[2], ARGV[3], current)
  redis.call("ZREMRANGEBYSCORE", KEYS[2], "-inf", "(" .. ARGV[4])
end
return count
