--[[
  Complete attempts of tasks of one queue: a batch, in one atomic step.

  For each completion, the writes the idempotency contract orders:
    1. task hash to its new status (with result or error, and the log)
    2. lifecycle event
    3. follow-up write: retry schedule (delayed set) or DLQ entry
    4. idempotency record state (SET XX KEEPTTL; none for keyless tasks)
    5. ACK (and removal) of the stream message: one XACK for the batch,
       after every other write
  No reader sees a task half-completed: the whole batch is one script.

  Input:
    KEYS[1] ready stream      dtq:stream:{q}
    KEYS[2] delayed set       dtq:delayed:{q}
    KEYS[3] dead-letter set   dtq:dlq:{q}
    KEYS[4] events stream     dtq:events:{q}
    KEYS[5 + i]  the task hash of completion i (from 0), dtq:task:{q}:<id>
    then the idempotency records dtq:idempotency:{q}:<key> of the
    completions that have a key, in their order (none for the others)

    ARGV[1] consumer group
    ARGV[2] retention of terminal task hashes (s)
    ARGV[3] events stream max length
    then, per completion in order, from ARGV[4]:
      task id; stream message id ("" for a task not in the stream);
      outcome: success | fatal | retry | lost | cancelled | expired | defer;
      result (JSON, for success) or error message; captured log;
      now (ms since epoch); "1" when the task has an idempotency key (its
      record is the next of the records in KEYS), else "0";
      digest of the module the attempt ran ("" when unknown);
      when a carried attempt started (ms since epoch), "" for an attempt
      `start` began;
      then, but for a carried attempt (which is always attempt 1), the
      attempt this completion belongs to ("" for expired);
      then, for retry and lost only, the retry due time (ms since epoch);
      for defer only, the defer limit: how long (ms) the task may wait for
      a handler in one spell of deferrals, "0" for no bound.
    A completion sends only what its outcome reads: every value sent costs
    Redis a parse and a Lua string.

    A carried attempt ran from its stream message alone (ingest.lua): no
    `start` wrote it, so the hash is still QUEUED, attempts 0, naming that
    message. Such a hash is this attempt's (attempt 1): the completion
    writes what `start` would have (attempts, started_at) with the rest,
    in the same HSET on success, where an empty log is not written: the
    hash has none yet, and a reader takes a missing log as empty. Anything
    else found (the attempt written by its first heartbeat, the message
    reclaimed and started elsewhere, the task completed) is checked as for
    any attempt.

    "lost" is a failed attempt like "retry", for a task whose worker died
    during it: that attempt left no log, so the task's log (an earlier
    attempt's) is left as it is.

    "defer" gives back an attempt that did not run: the worker has no
    handler for the task (not loaded yet, or it cannot run it). The attempt
    is not counted, and the task waits in the delayed set, SCHEDULED, for
    any worker: DEFER_BASE_MS doubling with each deferral of the task
    (field `deferrals`), at most DEFER_MAX_MS. A deferred task whose cancel
    was requested is CANCELLED instead. A spell of deferrals (field
    `deferred_since`, "<attempts spent>:<ms>" of its first: a run in between
    counts an attempt, and so starts a new spell) longer than the defer
    limit ends the task FAILED, its error naming the handler it waited
    for: no task waits unbounded for a handler nobody deploys.

  Every attempt that ran appends its module digest to the task's field
  `digests` (comma-separated, "-" for an attempt whose worker died), but a
  "lost" attempt that reclaim.lua already archived (and so counted).

  Attempt history (include/attempts.lua): an attempt that leaves the task
  RETRYING is archived as `attempt:<n>`, with the hash's `started_at`
  (written by start.lua for this attempt), now as its end, this
  completion's error, log (none for "lost") and digest. An attempt that
  ends the task stays in the hash's fields only; so does every attempt of
  the happy path, which writes nothing more.

  Output: one string, a word per completion, in order, each after a space
  ("SUCCEEDED -4:RUNNING RETRYING"): one value for the batch, where an
  array of two per completion would be as many values for Redis to send
  and the worker to parse. The word is the status for OK, `code:status`
  for any other code.
    1, status     OK: the task's new status (SUCCEEDED, FAILED, RETRYING,
                  DEAD_LETTERED, CANCELLED, EXPIRED)
    -4, status    STALE: the task is not in the state this completion belongs
                  to (reclaimed by another worker, or already completed);
                  nothing was written for it, its message not acknowledged
  An unknown outcome is an error, before anything is written.

  A retry of a task whose cancel was requested while it ran becomes
  CANCELLED; a retry with no attempts left becomes DEAD_LETTERED.
  Dead-lettered hashes keep no TTL, so a DLQ entry never outlives its
  hash: they stay until requeued or purged (by an admin, or by the
  workers' retention sweep, --dlq-retention-s / --dlq-max, through
  dlq_purge.lua).

  Events: the new status of each task, one stream entry for the batch
  (`pushEvent`, include/idem.lua), written before the ACK.
]]
-- Locals, not globals: a global is a table lookup at each use, and the
-- loop below reads ARGV a dozen times per completion.
local KEYS, ARGV, rcall = KEYS, ARGV, redis.call

local streamKey, delayedKey, dlqKey, eventsKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, retention, eventsMaxLen = ARGV[1], ARGV[2], ARGV[3]

local DEFER_BASE_MS, DEFER_MAX_MS = 250, 30000

local waiting = { QUEUED = true, SCHEDULED = true, RETRYING = true }
local failed = { retry = true, lost = true }
local direct = { success = "SUCCEEDED", fatal = "FAILED", cancelled = "CANCELLED", expired = "EXPIRED" }
local acks = {}

-- Where each completion's values start in ARGV; every outcome is checked
-- before anything is written.
local starts, count = {}, 0
local a, argc = 4, #ARGV
while a <= argc do
  local outcome = ARGV[a + 2]
  if not (direct[outcome] or failed[outcome] or outcome == "defer") then
    return redis.error_reply("ERR unknown outcome " .. tostring(outcome))
  end
  count = count + 1
  starts[count] = a
  a = a + 9
  if ARGV[a - 1] == "" then
    a = a + 1
  end
  if failed[outcome] or outcome == "defer" then
    a = a + 1
  end
end

-- Numbers stay the strings they came as: Lua formats numbers slowly.
-- Returns the completion's code and the task's status.
local function completeOne(taskKey, idemKey, a)
  local taskId, msgId, outcome, detail, log, now, hasKey, digest, carriedAt =
    ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5],
    ARGV[a + 6] == "1", ARGV[a + 7], ARGV[a + 8]
  local attempt, retryAt, deferLimit = "1", nil, nil
  a = a + 9
  if carriedAt == "" then
    attempt, a = ARGV[a], a + 1
  end
  if failed[outcome] then
    retryAt = ARGV[a]
  elseif outcome == "defer" then
    deferLimit = ARGV[a]
  end

  -- The common case first, with the least reading: a carried attempt that
  -- succeeded. It was the task's first, so there is no earlier error to
  -- clear nor digests to append to. Any other state found (its first beat
  -- wrote the attempt, or it is not this attempt's) takes the full path.
  if carriedAt ~= "" and outcome == "success" then
    local c = rcall("HMGET", taskKey, "status", "msg_id", "attempts")
    if carriedFirst(c[1], c[3], c[2], msgId) then
      digest = digest ~= "" and digest or "-"
      -- Each field the hash lacks costs a scan of it and an append: a
      -- handler that logged nothing adds no `log`.
      if log == "" then
        rcall("HSET", taskKey, "status", "SUCCEEDED", "attempts", "1", "updated_at", now,
          "result", detail, "finished_at", now, "digests", digest, "started_at", carriedAt)
      else
        rcall("HSET", taskKey, "status", "SUCCEEDED", "attempts", "1", "updated_at", now,
          "log", log, "result", detail, "finished_at", now, "digests", digest,
          "started_at", carriedAt)
      end
      rcall("EXPIRE", taskKey, retention)
      pushEvent(taskId, "SUCCEEDED", "1", now)
      if hasKey then
        setIdemState(idemKey, taskId, "completed", now)
      end
      acks[#acks + 1] = msgId
      return 1, "SUCCEEDED"
    end
  end

  local f = rcall("HMGET", taskKey, "status", "msg_id", "attempts", "max_attempts",
    "cancel_requested", "error", "digests")
  local current, attempts, maxAttempts, cancelRequested, hadError, digests =
    f[1], f[3] or "0", f[4] or "1", f[5] == "1", f[6], f[7]
  -- The carried attempt's own fields, written with the outcome's.
  local began = nil
  if carriedAt ~= "" and carriedFirst(current, f[3], f[2], msgId) then
    current, attempts = "RUNNING", "1"
    began = carriedAt
  end
  if outcome == "expired" then
    if not waiting[current] then
      return -4, current or "MISSING"
    end
  elseif current ~= "RUNNING" or attempts ~= attempt then
    return -4, current or "MISSING"
  end

  if outcome == "defer" then
    if msgId ~= "" then
      acks[#acks + 1] = msgId
    end
    -- The attempt is given back: a deferred task that ends here ends
    -- with the attempts it had before this one.
    local before = tonumber(attempts) - 1
    local function endUnrun(status, err)
      rcall("HSET", taskKey, "status", status, "updated_at", now, "attempts", before,
        "error", err, "finished_at", now)
      rcall("EXPIRE", taskKey, retention)
      pushEvent(taskId, status, before, now)
      if hasKey then
        setIdemState(idemKey, taskId, "failed", now)
      end
      return 1, status
    end
    if cancelRequested then
      return endUnrun("CANCELLED", "cancelled before it ran")
    end
    local limit = tonumber(deferLimit)
    local spent, since = string.match(rcall("HGET", taskKey, "deferred_since") or "",
      "^(%d+):(%d+)$")
    if tonumber(spent) ~= before then
      since = nil
    end
    if since and limit > 0 and tonumber(now) - tonumber(since) >= limit then
      local waited = tonumber(now) - tonumber(since)
      return endUnrun("FAILED", string.format(
        "gave up after waiting %d ms for a handler (defer limit %d ms): %s", waited, limit, detail))
    end
    if not since then
      rcall("HSET", taskKey, "deferred_since", before .. ":" .. now)
    end
    local n = rcall("HINCRBY", taskKey, "deferrals", 1)
    local due = tonumber(now) + math.min(DEFER_BASE_MS * 2 ^ math.min(n - 1, 16), DEFER_MAX_MS)
    rcall("HSET", taskKey, "status", "SCHEDULED", "updated_at", now,
      "attempts", before, "error", detail, "run_at", due)
    pushEvent(taskId, "SCHEDULED", before, now)
    rcall("ZADD", delayedKey, due, taskId)
    return 1, "SCHEDULED"
  end

  if began then
    rcall("HSET", taskKey, "attempts", "1", "started_at", began)
  end

  local status = direct[outcome]
  if failed[outcome] then
    if cancelRequested then
      status = "CANCELLED"
    elseif tonumber(attempts) >= tonumber(maxAttempts) then
      status = "DEAD_LETTERED"
    else
      status = "RETRYING"
    end
  end

  -- 1. The task hash.
  local detailField = status == "SUCCEEDED" and "result" or "error"
  local timeField, at = "finished_at", now
  if status == "RETRYING" then
    timeField, at = "run_at", retryAt
  end
  local counted = false
  if outcome == "lost" then
    counted = rcall("HEXISTS", taskKey, "attempt:" .. attempt) == 1
  end
  if outcome ~= "expired" and not counted then
    if digest == "" then
      digest = "-"
    end
    digests = digests and (digests .. "," .. digest) or digest
  end
  if status == "RETRYING" then
    local lostLog = outcome ~= "lost" and log or nil
    archiveAttempt(taskKey, tonumber(attempt), outcome, detail, lostLog,
      rcall("HGET", taskKey, "started_at"), now, digest)
  end
  if outcome == "lost" then
    rcall("HSET", taskKey, "status", status, "updated_at", now, detailField, detail,
      timeField, at, "digests", digests)
  elseif outcome == "expired" then
    rcall("HSET", taskKey, "status", status, "updated_at", now, "log", log,
      detailField, detail, timeField, at)
  else
    rcall("HSET", taskKey, "status", status, "updated_at", now, "log", log,
      detailField, detail, timeField, at, "digests", digests)
  end
  if status == "SUCCEEDED" and hadError then
    rcall("HDEL", taskKey, "error")
  end
  if status ~= "RETRYING" and status ~= "DEAD_LETTERED" then
    rcall("EXPIRE", taskKey, retention)
  end

  -- 2. The lifecycle event (written for the batch, below).
  pushEvent(taskId, status, attempts, now)

  -- 3. The follow-up write.
  if status == "RETRYING" then
    rcall("ZADD", delayedKey, retryAt, taskId)
  elseif status == "DEAD_LETTERED" then
    rcall("ZADD", dlqKey, now, taskId)
  end

  -- 4. The idempotency record: a retrying task stays "processing".
  if hasKey and status ~= "RETRYING" then
    setIdemState(idemKey, taskId, status == "SUCCEEDED" and "completed" or "failed", now)
  end

  -- 5. The ACK, for the whole batch at the end of the script. An expired
  -- task may be waiting in the delayed set instead of the stream.
  if msgId ~= "" then
    acks[#acks + 1] = msgId
  end
  if outcome == "expired" then
    rcall("ZREM", delayedKey, taskId)
  end
  return 1, status
end

local DASH = string.byte("-")

local function parseId(id)
  local ms, seq = string.match(id, "^(%d+)-(%d+)$")
  return tonumber(ms), tonumber(seq)
end

-- The ids among `ids` not older than stream id `from`. Ids are
-- "<ms>-<seq>", both parts decimal without leading zeros, so two ids of one
-- length with the dash in one place compare as strings (digits collate in
-- order in every locale); others are compared as numbers.
local function notOlder(ids, from)
  local len, dash = #from, string.find(from, "-", 1, true)
  local fromMs, fromSeq
  local out = {}
  for _, id in ipairs(ids) do
    local newer
    if #id == len and string.byte(id, dash) == DASH then
      newer = id >= from
    else
      if not fromMs then
        fromMs, fromSeq = parseId(from)
      end
      local ms, seq = parseId(id)
      newer = ms > fromMs or (ms == fromMs and seq >= fromSeq)
    end
    if newer then
      out[#out + 1] = id
    end
  end
  return out
end

local out = {}
local record = 5 + count
for i = 1, count do
  local first, idemKey = starts[i], nil
  if ARGV[first + 6] == "1" then
    idemKey, record = KEYS[record], record + 1
  end
  local code, status = completeOne(KEYS[4 + i], idemKey, first)
  -- An OK word is the status alone: no string is built for it.
  out[i] = code == 1 and status or code .. ":" .. status
end

-- 2. The batch's lifecycle events, in one entry.
flushEvents(eventsKey, eventsMaxLen)

-- 5. The ACK, then the acknowledged entries leave the stream, so that it
-- holds only what is ready or running and its length is that depth. Every
-- entry older than the oldest pending one is acknowledged (the group reads
-- in order, ids only grow, and it is the stream's only group): one XTRIM
-- MINID removes those, usually most of this batch, far cheaper than
-- deleting them one by one; XDEL removes the rest.
if #acks > 0 then
  rcall("XACK", streamKey, group, unpack(acks))
  local oldest = rcall("XPENDING", streamKey, group, "-", "+", 1)[1]
  local rest = acks
  if oldest then
    rcall("XTRIM", streamKey, "MINID", oldest[1])
    rest = notOlder(acks, oldest[1])
  end
  if #rest > 0 then
    rcall("XDEL", streamKey, unpack(rest))
  end
end
return table.concat(out, " ")
