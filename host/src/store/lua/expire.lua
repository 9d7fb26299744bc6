--[[
  Expire waiting tasks whose expiry has passed, on time, whether or not a
  worker reaches them: the workers' sweep over the expiry index.

  The caller reads the due ids first (ZRANGE ... BYSCORE on the index) and
  passes each task's hash and idempotency record in KEYS. ZREM decides who
  handles each entry: of several workers sweeping at once, exactly one
  removes it, and `start` removes the entry of every task it hands to a
  worker, so a task is never expired here while a worker runs it.

  A task still waiting (QUEUED, SCHEDULED, RETRYING) becomes EXPIRED with
  the writes of the expiry path of complete.lua (outcome "expired"):
    1. task hash: status EXPIRED, updated_at, log "", error, finished_at;
       the retention TTL
    2. lifecycle event EXPIRED
    3. out of the delayed set (a scheduled task waits there)
    4. idempotency record "failed" (`setIdemState`; none for keyless tasks)
    5. its stream message deleted, when the hash names it (`msg_id`, kept
       by ingest.lua for a task with an expiry that went straight to the
       stream; no task in the index has started, so it is that message):
       the queue's depth drops at once. A message this cannot name (a
       scheduled task promoted since) stays until a worker reads it, and
       start.lua acknowledges and deletes it as it does for every
       terminal task.
  An entry whose task is no longer waiting (cancelled, gone) is dropped.
  A task with a parent (flows) that expires joins the settle index, for
  the sweeper to tell its parent.

  Input:
    KEYS[1] expiry index    dtq:expiry:{q}
    KEYS[2] delayed set     dtq:delayed:{q}
    KEYS[3] ready stream    dtq:stream:{q}
    KEYS[4] events stream   dtq:events:{q}
    KEYS[5] settle index    dtq:settle:{q}
    then, per task i (from 0):
    KEYS[6 + 2i] task hash            dtq:task:{q}:<id>
    KEYS[7 + 2i] idempotency record   dtq:idempotency:{q}:<key> (ignored unless it has a key)

    ARGV by name (the ARG_ locals below; store/expiry.rs, EXPIRE_ARGV):
    ARG_NOW             now (ms since epoch)
    ARG_RETENTION       retention of terminal task hashes (s)
    ARG_EVENTS_MAX_LEN  events stream max length
    ARG_DETAIL          error message of an expired task
    then, per task i, 2 values from ARG_TASKS + 2i:
      task id; "1" when the task has an idempotency key

  Output: the number of tasks expired.

  Events: EXPIRED for each task expired.
]]
local ARG_NOW = 1
local ARG_RETENTION = 2
local ARG_EVENTS_MAX_LEN = 3
local ARG_DETAIL = 4
local ARG_TASKS = 5

local expiryKey, delayedKey, streamKey, eventsKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local settleKey = KEYS[5]
local now, retention = ARGV[ARG_NOW], ARGV[ARG_RETENTION]
local eventsMaxLen, detail = ARGV[ARG_EVENTS_MAX_LEN], ARGV[ARG_DETAIL]
local nowMs = tonumber(now)

local waiting = { QUEUED = true, SCHEDULED = true, RETRYING = true }
local expired = 0

for i = 0, (#KEYS - 5) / 2 - 1 do
  local taskKey, idemKey = KEYS[6 + 2 * i], KEYS[7 + 2 * i]
  local a = ARG_TASKS + 2 * i
  local taskId, hasKey = ARGV[a], ARGV[a + 1] == "1"
  local due = redis.call("ZSCORE", expiryKey, taskId)
  if due and tonumber(due) <= nowMs and redis.call("ZREM", expiryKey, taskId) == 1 then
    local f = redis.call("HMGET", taskKey, "status", "attempts", "msg_id", "parent")
    if waiting[f[1]] then
      redis.call("HSET", taskKey, "status", "EXPIRED", "updated_at", now, "log", "",
        "error", detail, "finished_at", now)
      redis.call("EXPIRE", taskKey, retention)
      addEvent(eventsKey, eventsMaxLen, taskId, "EXPIRED", f[2] or "0", now)
      redis.call("ZREM", delayedKey, taskId)
      if hasKey then
        setIdemState(idemKey, taskId, "failed", now)
      end
      if f[3] then
        redis.call("XDEL", streamKey, f[3])
      end
      if f[4] then
        redis.call("ZADD", settleKey, now, taskId)
      end
      expired = expired + 1
    end
  end
end
return expired
