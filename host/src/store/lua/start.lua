--[[
  Start a batch of fetched (or reclaimed) stream messages: decide for each
  whether it runs, and mark the runnable ones RUNNING with one more attempt.

  Input:
    KEYS[1] ready stream   dtq:stream:{q}
    KEYS[2] events stream  dtq:events:{q}
    KEYS[3..] one task hash per message, dtq:task:{q}:<id>

    ARGV[1] consumer group
    ARGV[2] now (ms since epoch)
    ARGV[3] consumer (worker) name
    ARGV[4] events stream max length
    ARGV[5..] one stream message id per task hash, in the same order

  Output: one entry per message, in order:
    {1, fields...}  RUN: the task hash (after the update) as a flat list
    {0, status}     SKIP: already terminal, or its hash is gone; the message
                    was acknowledged and deleted here
    {4, fields...}  EXPIRED: not started before its expiry; the caller
                    completes it as EXPIRED (it needs the idempotency key)
    {5, fields...}  EXHAUSTED: found RUNNING (its worker died) with no
                    attempts left; the caller dead-letters it

  Events: RUNNING for each started task.
]]
local streamKey, eventsKey = KEYS[1], KEYS[2]
local group, now, consumer, eventsMaxLen = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]

local waiting = { QUEUED = true, SCHEDULED = true, RETRYING = true }
local out = {}
local acks = {}
for i = 3, #KEYS do
  local taskKey, msgId = KEYS[i], ARGV[i + 2]
  -- One read of the whole hash: the decision needs a few fields, and a task
  -- that runs is handed over whole.
  local flat = redis.call("HGETALL", taskKey)
  local at = {}
  for j = 1, #flat, 2 do
    at[flat[j]] = j + 1
  end
  local function get(name)
    local j = at[name]
    return j and flat[j]
  end
  local status = get("status")
  if not status or not (waiting[status] or status == "RUNNING") then
    acks[#acks + 1] = msgId
    out[#out + 1] = {0, status or "MISSING"}
  else
    local expiresAt = tonumber(get("expires_at") or "0")
    local attempts = tonumber(get("attempts") or "0")
    local maxAttempts = tonumber(get("max_attempts") or "1")
    if waiting[status] and expiresAt > 0 and now >= expiresAt then
      out[#out + 1] = {4, flat}
    elseif status == "RUNNING" and attempts >= maxAttempts then
      out[#out + 1] = {5, flat}
    else
      attempts = attempts + 1
      local update = {"status", "RUNNING", "attempts", attempts, "started_at", now,
        "updated_at", now, "worker", consumer, "msg_id", msgId}
      redis.call("HSET", taskKey, unpack(update))
      for j = 1, #update, 2 do
        local k = at[update[j]]
        if k then
          flat[k] = update[j + 1]
        else
          flat[#flat + 1] = update[j]
          flat[#flat + 1] = update[j + 1]
        end
      end
      addEvent(eventsKey, eventsMaxLen, get("id"), "RUNNING", attempts, now)
      out[#out + 1] = {1, flat}
    end
  end
end
if #acks > 0 then
  redis.call("XACK", streamKey, group, unpack(acks))
  redis.call("XDEL", streamKey, unpack(acks))
end
return out
