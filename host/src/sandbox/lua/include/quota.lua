-- A namespace's Redis budget: what its kv keys and its idempotency claims
-- hold, charged by one rule (sandbox/quota.rs says why these numbers):
--
--   a kv key   KEY_OVERHEAD + bytes of its name + bytes of its value
--   a claim    CLAIM_OVERHEAD + bytes of its key + bytes of its result
--
-- The overheads stand for what Redis holds per key beyond the bytes named:
-- the key object, its TTL, its encoding, and this file's own entries for it
-- (a count field and an index entry). The host puts their values before
-- this file (`local KEY_OVERHEAD, CLAIM_OVERHEAD = …`), and Redis's clock
-- (`redisTimeMs`, store/lua/include/clock.lua).
--
-- Every script that includes this file takes the same six inputs first:
--   KEYS[2] quotaKey   dtq:quota:{<ns>}         hash: "used" = bytes charged
--                      in all; "k:<key>" one kv key's; "c:<key>" one claim's
--   KEYS[3] ttlKey     dtq:quota-ttl:{<ns>}     sorted set: kv key -> when
--                      its TTL ends (ms)
--   KEYS[4] claimsKey  dtq:quota-claims:{<ns>}  sorted set: claim key ->
--                      when it expires (ms); every live claim is in it
--   ARGV by name (the ARG_ locals below, the first of every such script's
--   own; sandbox/quota.rs, argv):
--   ARG_KV_PREFIX     the kv keys' prefix      dtq:guest:{<ns>}:
--   ARG_CLAIM_PREFIX  the claims' prefix       dtq:claim:{<ns>}:
--   ARG_BUDGET        the budget in bytes, "0" for none
--
-- Keys and claims that expire leave by themselves; `reconcile` takes them
-- off the count a few at a time, on later writes, and all that are due
-- before a write is refused for want of room. Every key of the namespace
-- shares its hash tag, so the keys built here from the prefixes are in the
-- script's slot.

local ARG_KV_PREFIX = 1
local ARG_CLAIM_PREFIX = 2
local ARG_BUDGET = 3

local Q = {
  quotaKey = KEYS[2], ttlKey = KEYS[3], claimsKey = KEYS[4],
  kvPrefix = ARGV[ARG_KV_PREFIX], claimPrefix = ARGV[ARG_CLAIM_PREFIX],
  budget = tonumber(ARGV[ARG_BUDGET]),
}

-- The bytes a kv key of name `suffix` holding `len` bytes is charged.
local function kvSize(suffix, len)
  return KEY_OVERHEAD + #suffix + len
end

-- The bytes a claim on `suffix` keeping a result of `len` bytes is charged.
local function claimSize(suffix, len)
  return CLAIM_OVERHEAD + #suffix + len
end

-- The bytes `field` ("k:<key>", "c:<key>") is charged now.
local function sizeOf(field)
  return tonumber(redis.call("HGET", Q.quotaKey, field) or "0")
end

local function usedOf()
  return tonumber(redis.call("HGET", Q.quotaKey, "used") or "0")
end

-- Charge `field` `size` bytes (0: gone).
local function record(field, size)
  local delta = size - sizeOf(field)
  if size == 0 then
    redis.call("HDEL", Q.quotaKey, field)
  else
    redis.call("HSET", Q.quotaKey, field, size)
  end
  if delta ~= 0 then
    redis.call("HINCRBY", Q.quotaKey, "used", delta)
  end
end

-- A claim on `suffix` is gone (aborted, refused): off the count and the index.
local function dropClaim(suffix)
  record("c:" .. suffix, 0)
  redis.call("ZREM", Q.claimsKey, suffix)
end

-- Take up to `max` entries of `index` whose time has come off the count;
-- one still there (its TTL moved) is indexed again at its new end.
local function reconcileIndex(index, prefix, tag, now, max)
  local due = redis.call("ZRANGEBYSCORE", index, "-inf", now, "LIMIT", 0, max)
  for _, suffix in ipairs(due) do
    local left = redis.call("PTTL", prefix .. suffix)
    if left > 0 then
      redis.call("ZADD", index, now + left, suffix)
    else
      if left == -2 then
        record(tag .. suffix, 0)
      end
      redis.call("ZREM", index, suffix)
    end
  end
  return #due
end

-- Take up to `max` expired kv keys and up to `max` expired claims off the
-- count; the number taken.
local function reconcile(now, max)
  return reconcileIndex(Q.ttlKey, Q.kvPrefix, "k:", now, max)
    + reconcileIndex(Q.claimsKey, Q.claimPrefix, "c:", now, max)
end

-- Whether the bytes `delta()` says a write adds stay within the budget (0:
-- none), once what expired is off the count: up to 1,024 keys and as many
-- claims are taken off here, so one refused write costs Redis a bounded
-- pause. `delta` is asked again after each round, as what it compares
-- against may have been taken off.
local function fits(now, delta)
  if Q.budget == 0 then
    return true
  end
  for _ = 1, 4 do
    local d = delta()
    if d <= 0 or usedOf() + d <= Q.budget then
      return true
    end
    if reconcile(now, 256) == 0 then
      return false
    end
  end
  local d = delta()
  return d <= 0 or usedOf() + d <= Q.budget
end

-- The claims of the namespace that have not expired.
local function liveClaims(now)
  return redis.call("ZCOUNT", Q.claimsKey, "(" .. now, "+inf")
end
