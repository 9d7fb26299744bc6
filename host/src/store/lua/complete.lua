--[[
  Complete one attempt of a task. All completion writes, in the order the
  idempotency contract fixes, in one atomic step:
    1. task hash to its new status (with result or error, and the log)
    2. lifecycle event
    3. follow-up write: retry schedule (delayed set) or DLQ entry
    4. idempotency record state (SET XX KEEPTTL; none for keyless tasks)
    5. ACK (and delete) of the stream message

  Input:
    KEYS[1] task hash            dtq:task:{q}:<id>
    KEYS[2] ready stream         dtq:stream:{q}
    KEYS[3] delayed set          dtq:delayed:{q}
    KEYS[4] dead-letter set      dtq:dlq:{q}
    KEYS[5] events stream        dtq:events:{q}
    KEYS[6] idempotency record   dtq:idempotency:{q}:<key> (ignored unless ARGV[8] == "1")

    ARGV[1]  task id
    ARGV[2]  stream message id
    ARGV[3]  consumer group
    ARGV[4]  outcome: success | fatal | retry | cancelled | expired
    ARGV[5]  result (JSON, for success) or error message
    ARGV[6]  captured log
    ARGV[7]  now (ms since epoch)
    ARGV[8]  "1" when the task has an idempotency key
    ARGV[9]  the attempt this completion belongs to ("" for expired)
    ARGV[10] retry due time (ms since epoch), used when the outcome retries
    ARGV[11] retention of terminal task hashes (s)
    ARGV[12] events stream max length

  Output:
    {1, status}   OK: the task's new status (SUCCEEDED, FAILED, RETRYING,
                  DEAD_LETTERED, CANCELLED, EXPIRED)
    {-4, status}  STALE: the task is not in the state this completion belongs
                  to (reclaimed by another worker, or already completed);
                  nothing was written, the message is not acknowledged

  A retry of a task whose cancel was requested while it ran becomes
  CANCELLED; a retry with no attempts left becomes DEAD_LETTERED.
  Dead-lettered hashes keep no TTL: they stay until requeued or purged.

  Events: the new status.
]]
local taskKey, streamKey, delayedKey, dlqKey, eventsKey, idemKey =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local taskId, msgId, group, outcome, detail, log, now =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local hasKey, attempt, retryAt = ARGV[8] == "1", ARGV[9], ARGV[10]
local retention, eventsMaxLen = tonumber(ARGV[11]), ARGV[12]

local f = redis.call("HMGET", taskKey, "status", "attempts", "max_attempts", "cancel_requested")
local current, attempts, maxAttempts, cancelRequested =
  f[1], tonumber(f[2] or "0"), tonumber(f[3] or "1"), f[4] == "1"

if outcome == "expired" then
  if current ~= "QUEUED" and current ~= "SCHEDULED" and current ~= "RETRYING" then
    return {-4, current or "MISSING"}
  end
elseif current ~= "RUNNING" or tostring(attempts) ~= attempt then
  return {-4, current or "MISSING"}
end

local status
if outcome == "success" then
  status = "SUCCEEDED"
elseif outcome == "fatal" then
  status = "FAILED"
elseif outcome == "cancelled" then
  status = "CANCELLED"
elseif outcome == "expired" then
  status = "EXPIRED"
elseif outcome == "retry" then
  if cancelRequested then
    status = "CANCELLED"
  elseif attempts >= maxAttempts then
    status = "DEAD_LETTERED"
  else
    status = "RETRYING"
  end
else
  return redis.error_reply("ERR unknown outcome " .. tostring(outcome))
end

-- 1. The task hash.
redis.call("HSET", taskKey, "status", status, "updated_at", now, "log", log)
if status == "SUCCEEDED" then
  redis.call("HSET", taskKey, "result", detail)
  redis.call("HDEL", taskKey, "error")
elseif status ~= "EXPIRED" or detail ~= "" then
  redis.call("HSET", taskKey, "error", detail)
end
if status == "RETRYING" then
  redis.call("HSET", taskKey, "run_at", retryAt)
else
  redis.call("HSET", taskKey, "finished_at", now)
  if status ~= "DEAD_LETTERED" then
    redis.call("EXPIRE", taskKey, retention)
  end
end

-- 2. The lifecycle event.
addEvent(eventsKey, eventsMaxLen, taskId, status, attempts, now)

-- 3. The follow-up write.
if status == "RETRYING" then
  redis.call("ZADD", delayedKey, retryAt, taskId)
elseif status == "DEAD_LETTERED" then
  redis.call("ZADD", dlqKey, now, taskId)
end

-- 4. The idempotency record: a retrying task stays "processing".
if hasKey and status ~= "RETRYING" then
  local state = "failed"
  if status == "SUCCEEDED" then
    state = "completed"
  end
  setIdemState(idemKey, taskId, state, now)
end

-- 5. The ACK. An expired task may be waiting in the delayed set instead.
if msgId ~= "" then
  redis.call("XACK", streamKey, group, msgId)
  redis.call("XDEL", streamKey, msgId)
end
if outcome == "expired" then
  redis.call("ZREM", delayedKey, taskId)
end
return {1, status}
