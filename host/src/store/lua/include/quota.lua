-- A namespace's Redis budget: what its kv keys hold, counted in bytes of
-- key names (after the namespace prefix) and values.
--
--   quotaKey  dtq:quota:{<ns>}      hash: "used" = bytes in all; "k:<key>" =
--                                   bytes of one key
--   ttlKey    dtq:quota-ttl:{<ns>}  sorted set: key -> when its TTL ends (ms)
--
-- Keys that expire leave by themselves; `reconcile` takes their bytes off
-- the count a few at a time, on later writes. Every kv key of the namespace
-- shares its hash tag, so the keys built here from the prefix are in the
-- script's slot.

local function nowMs()
  local t = redis.call("TIME")
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The bytes `suffix` counts for now.
local function sizeOf(quotaKey, suffix)
  return tonumber(redis.call("HGET", quotaKey, "k:" .. suffix) or "0")
end

local function usedOf(quotaKey)
  return tonumber(redis.call("HGET", quotaKey, "used") or "0")
end

-- Count `suffix` as `size` bytes (0: gone).
local function record(quotaKey, suffix, size)
  local delta = size - sizeOf(quotaKey, suffix)
  if size == 0 then
    redis.call("HDEL", quotaKey, "k:" .. suffix)
  else
    redis.call("HSET", quotaKey, "k:" .. suffix, size)
  end
  if delta ~= 0 then
    redis.call("HINCRBY", quotaKey, "used", delta)
  end
end

-- Take the bytes of up to `max` keys whose TTL has ended off the count.
local function reconcile(quotaKey, ttlKey, prefix, now, max)
  local due = redis.call("ZRANGEBYSCORE", ttlKey, "-inf", now, "LIMIT", 0, max)
  for _, suffix in ipairs(due) do
    if redis.call("EXISTS", prefix .. suffix) == 0 then
      record(quotaKey, suffix, 0)
    end
    redis.call("ZREM", ttlKey, suffix)
  end
end

-- Whether `suffix` growing by `delta` bytes stays within `budget` (0: none).
local function fits(quotaKey, delta, budget)
  return budget == 0 or delta <= 0 or usedOf(quotaKey) + delta <= budget
end
