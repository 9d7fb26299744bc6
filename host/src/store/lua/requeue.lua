--[[
  Requeue dead-lettered tasks of one queue (admin): each back to the ready
  stream with a fresh budget of attempts, and its idempotency record back
  to "processing", so that a resubmission with its key gets 409 (the task
  runs again) rather than a replay of the dead-lettered attempt. A record
  that expired meanwhile (or names a task that is gone) is recreated with a
  full TTL for the same reason.

  One key, one live task: a task whose key now names another task (its
  record expired and the key was submitted again, or the key's records were
  forwarded to another partition for another task) is not requeued, and
  stays dead-lettered: the key belongs to the other task.

  Records live where keyed submissions look for them: this script keeps the
  record in the task's own partition; when the key routes to another
  partition now (a raise of the partition count moved it), the host first
  writes a forward there (idem_forward.lua, store/dlq.rs) and only then
  calls this script.

  One id (POST .../dlq/{id}/requeue) or a chunk of a bulk requeue (POST
  .../dlq/requeue: the host sends at most DLQ_CHUNK ids per call, so that
  no call holds Redis for long); each task is requeued atomically, and so
  is the whole chunk.

  Input:
    KEYS[1] dead-letter set   dtq:dlq:{q}
    KEYS[2] ready stream      dtq:stream:{q}
    KEYS[3] events stream     dtq:events:{q}
    then, per task i (from 0):
    KEYS[4 + 2i] task hash            dtq:task:{q}:<id>
    KEYS[5 + 2i] idempotency record   dtq:idempotency:{q}:<key> (ignored unless it has a key)

    ARGV by name (the ARG_ locals below; store/dlq.rs, REQUEUE_ARGV):
    ARG_NOW             now (ms since epoch)
    ARG_IDEM_TTL        idempotency TTL (s), for a record that expired
    ARG_EVENTS_MAX_LEN  events stream max length
    ARG_TASK_PREFIX     prefix of task hashes of this queue, dtq:task:{q}:
                        (to tell whether the task another record names
                        still exists; read, although not in KEYS, in this
                        slot: see include/idem.lua)
    then, per task i, 2 values from ARG_TASKS + 2i:
      task id; "1" when the task has an idempotency key

  Output: one flat array, a code and a value per task, in order:
    1, "QUEUED"   requeued
    -7, status    not requeued: not dead-lettered (status is the task's,
                  or "" when its hash is gone). An id of the dead-letter
                  set whose task is gone or not dead-lettered is a dangling
                  entry: it is removed from the set.
    -10, id       not requeued: its idempotency key names task `id` now;
                  the task stays in the dead-letter set, unchanged.

  Attempts keep counting (a handler sees attempt numbers rise, never
  repeat); max_attempts grows by the task's original budget. The
  dead-lettered attempt, which lives in the hash's own fields, is archived
  first (include/attempts.lua) as "dead_lettered" (one reclaim.lua already
  archived as lost is relabelled so), so the task's attempt history runs
  on across the requeue.

  Events: QUEUED for each task requeued.
]]
local ARG_NOW = 1
local ARG_IDEM_TTL = 2
local ARG_EVENTS_MAX_LEN = 3
local ARG_TASK_PREFIX = 4
local ARG_TASKS = 5

local dlqKey, streamKey, eventsKey = KEYS[1], KEYS[2], KEYS[3]
local now, idemTtl = ARGV[ARG_NOW], tonumber(ARGV[ARG_IDEM_TTL])
local eventsMaxLen, taskPrefix = ARGV[ARG_EVENTS_MAX_LEN], ARGV[ARG_TASK_PREFIX]

-- Archive the dead-lettered attempt `n` from the hash's fields, labelled
-- "dead_lettered": it failed with no attempt left, or its worker died
-- (its digest is "-": no log). One reclaim.lua archived as lost keeps its
-- record, relabelled.
local function archiveLast(taskKey, n)
  if n == 0 then
    return
  end
  local field = "attempt:" .. n
  local archived = redis.call("HGET", taskKey, field)
  if archived then
    local record = cjson.decode(archived)
    record["outcome"] = "dead_lettered"
    redis.call("HSET", taskKey, field, cjson.encode(record))
    return
  end
  local f = redis.call("HMGET", taskKey, "error", "log", "started_at", "finished_at", "digests")
  local digest = lastDigest(f[5])
  if digest == "-" then
    archiveAttempt(taskKey, n, "dead_lettered", f[1], false, f[3], f[4], false)
  else
    archiveAttempt(taskKey, n, "dead_lettered", f[1], f[2], f[3], f[4], digest or false)
  end
end

-- Returns the task's code and its status (or the id the key names).
local function requeueOne(taskKey, idemKey, taskId, hasKey)
  local status = redis.call("HGET", taskKey, "status")
  if status ~= "DEAD_LETTERED" then
    redis.call("ZREM", dlqKey, taskId)
    return -7, status or ""
  end
  if redis.call("ZSCORE", dlqKey, taskId) == false then
    return -7, status
  end
  local other = hasKey and idemTakenBy(idemKey, taskId, taskPrefix)
  if other then
    return -10, other
  end
  redis.call("ZREM", dlqKey, taskId)
  local f = redis.call("HMGET", taskKey, "attempts", "budget", "max_attempts")
  local attempts = tonumber(f[1] or "0")
  local budget = tonumber(f[2] or f[3] or "1")
  archiveLast(taskKey, attempts)
  redis.call("HSET", taskKey, "status", "QUEUED", "max_attempts", attempts + budget,
    "updated_at", now, "requeued_at", now)
  redis.call("HDEL", taskKey, "finished_at", "cancel_requested")
  redis.call("PERSIST", taskKey)
  redis.call("XADD", streamKey, "*", "id", taskId)
  addEvent(eventsKey, eventsMaxLen, taskId, "QUEUED", attempts, now)
  -- Not taken (above): a record not rewritten is absent or stale.
  if hasKey and setIdemState(idemKey, taskId, "processing", now) == 0 then
    local fingerprint = redis.call("HGET", taskKey, "fingerprint") or ""
    redis.call("SET", idemKey, idemRecord(taskId, "processing", now, fingerprint), "EX", idemTtl)
  end
  return 1, "QUEUED"
end

local out = {}
for i = 0, (#KEYS - 3) / 2 - 1 do
  out[2 * i + 1], out[2 * i + 2] = requeueOne(KEYS[4 + 2 * i], KEYS[5 + 2 * i],
    ARGV[ARG_TASKS + 2 * i], ARGV[ARG_TASKS + 2 * i + 1] == "1")
end
return out
