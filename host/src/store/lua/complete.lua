--[[
  Complete attempts of tasks of one queue: a batch, in one atomic step.

  For each completion, the writes the idempotency contract orders:
    1. task hash to its new status (with result or error, and the log)
    2. lifecycle event
    3. follow-up write: retry schedule (delayed set) or DLQ entry
    4. idempotency record state (`setIdemState`: in place, or SET XX KEEPTTL; none for
       keyless tasks)
    5. ACK (and removal) of the stream message: one XACK for the batch,
       after every other write
  No reader sees a task half-completed: the whole batch is one script.

  Input:
    KEYS[1] ready stream      dtq:stream:{q}
    KEYS[2] delayed set       dtq:delayed:{q}
    KEYS[3] dead-letter set   dtq:dlq:{q}
    KEYS[4] events stream     dtq:events:{q}
    KEYS[5] flows index       dtq:flows:{q}
    KEYS[6] settle index      dtq:settle:{q}
    KEYS[7] waiting set       dtq:waiting:{q}
    KEYS[8 + i]  the task hash of completion i (from 0), dtq:task:{q}:<id>
    then the idempotency records dtq:idempotency:{q}:<key> of the
    completions that have a key, in their order (none for the others)
    then the flow hashes dtq:flow:{q}:<id> of the completions whose
    outcome is staged or wait, in their order

    ARGV by name (the ARG_ and C_ locals below; store/complete.rs,
    COMPLETE_ARGV and COMPLETION_ARGV):
    ARG_GROUP           consumer group
    ARG_RETENTION       retention of terminal task hashes (s)
    ARG_EVENTS_MAX_LEN  events stream max length
    then, per completion in order, from ARG_COMPLETIONS, at these offsets
    from where it starts:
      C_TASK_ID     task id
      C_MSG_ID      stream message id ("" for a task not in the stream)
      C_OUTCOME     success | staged | wait | fatal | retry | lost |
                    cancelled | expired | defer
      C_DETAIL      result (JSON, for success) or error message
      C_LOG         captured log
      C_NOW         now (ms since epoch)
      C_HAS_KEY     "1" when the task has an idempotency key (its record is
                    the next of the records in KEYS), else "0"
      C_DIGEST      digest of the module the attempt ran ("" when unknown)
      C_CARRIED_AT  when a carried attempt started (ms since epoch), "" for
                    an attempt `start` began
      then, from C_OPTIONAL: but for a carried attempt (which is always
      attempt 1), the attempt this completion belongs to ("" for expired);
      then, for retry and lost only, the retry due time (ms since epoch);
      for defer only, the defer limit: how long (ms) the task may wait for
      a handler in one spell of deferrals, "0" for no bound;
      for staged and wait only, the number of submissions the attempt
      staged, then each (JSON, see store/flow.rs).
    A completion sends only what its outcome reads: every value sent costs
    Redis a parse and a Lua string.

    A carried attempt ran from its stream message alone (ingest.lua): no
    `start` wrote it, so the hash is still QUEUED, attempts 0, naming that
    message. Such a hash is this attempt's (attempt 1): the completion
    writes what `start` would have (attempts, started_at) with the rest,
    in the same HSET on success, where an empty log is not written: the
    hash has none yet, and a reader takes a missing log as empty. Nor is
    `finished_at`: such a success writes `updated_at` with that time, and
    a reader takes it for a succeeded task without `finished_at`
    (store/task.rs, `finished_at`). Anything
    else found (the attempt written by its first heartbeat, the message
    reclaimed and started elsewhere, the task completed) is checked as for
    any attempt.

    "staged" is a success that staged submissions (flows): they go into
    the task's flow hash, its outbox (s:<eid> fields, include/flow.lua),
    and the task into the queue's flows index, in the same step as the
    success; the worker applies them next, and the sweeper does if the
    worker dies first. "wait" ends the attempt (its submissions staged the
    same way) with the task WAITING for its children: acknowledged, it
    holds no slot, its idempotency record stays "processing", and it is
    resumed (include/flow.lua) once its flow is settled, at once if it
    already is. A task that waited MAX_WAITS times fails instead: a
    handler that waits whatever its children did would otherwise run
    forever. A wait of a task whose cancel was requested cancels it.

    A task with a parent (field `parent`, "<queue>/<id>") that ends here
    (any status but RETRYING and WAITING) joins the queue's settle index
    (KEYS[6]): the worker, or the sweeper after it, tells the parent.

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
  for any other code; a task with a parent that ended has `^<parent>`
  appended ("FAILED^orders/<id>").
    1, status     OK: the task's new status (SUCCEEDED, FAILED, RETRYING,
                  DEAD_LETTERED, CANCELLED, EXPIRED, WAITING, QUEUED for
                  a wait resumed at once)
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
-- steps below read ARGV a dozen times per completion.
local KEYS, ARGV, rcall = KEYS, ARGV, redis.call

local ARG_GROUP = 1
local ARG_RETENTION = 2
local ARG_EVENTS_MAX_LEN = 3
local ARG_COMPLETIONS = 4

-- A completion's values, as offsets from where they start.
local C_TASK_ID = 0
local C_MSG_ID = 1
local C_OUTCOME = 2
local C_DETAIL = 3
local C_LOG = 4
local C_NOW = 5
local C_HAS_KEY = 6
local C_DIGEST = 7
local C_CARRIED_AT = 8
local C_OPTIONAL = 9

local streamKey, delayedKey, dlqKey, eventsKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local flowsKey, settleKey, waitingKey = KEYS[5], KEYS[6], KEYS[7]
local group, retention = ARGV[ARG_GROUP], ARGV[ARG_RETENTION]
local eventsMaxLen = ARGV[ARG_EVENTS_MAX_LEN]

local DEFER_BASE_MS, DEFER_MAX_MS = 250, 30000
local MAX_WAITS = 100

local waiting = { QUEUED = true, SCHEDULED = true, RETRYING = true }
local failed = { retry = true, lost = true }
local direct = { success = "SUCCEEDED", staged = "SUCCEEDED", fatal = "FAILED",
  cancelled = "CANCELLED", expired = "EXPIRED", wait = "WAITING" }
local staging = { staged = true, wait = true }
local acks = {}

-- Where each completion's values start in ARGV, and how many name an
-- idempotency record (in KEYS, before the flow hashes); every outcome is
-- checked before anything is written.
local starts, count, keyed = {}, 0, 0
local a, argc = ARG_COMPLETIONS, #ARGV
while a <= argc do
  local outcome = ARGV[a + C_OUTCOME]
  if not (direct[outcome] or failed[outcome] or outcome == "defer") then
    return redis.error_reply("ERR unknown outcome " .. tostring(outcome))
  end
  count = count + 1
  starts[count] = a
  if ARGV[a + C_HAS_KEY] == "1" then
    keyed = keyed + 1
  end
  local carried = ARGV[a + C_CARRIED_AT] ~= ""
  a = a + C_OPTIONAL
  if not carried then
    a = a + 1
  end
  if failed[outcome] or outcome == "defer" then
    a = a + 1
  end
  if staging[outcome] then
    a = a + 1 + tonumber(ARGV[a])
  end
end

-- The completion being written, set by `readCompletion` for each in turn
-- and read by the steps below. Numbers stay the strings they came as: Lua
-- formats numbers slowly.
local taskKey, idemKey, taskId, msgId, outcome, detail, log, now, hasKey, digest
local carriedAt, attempt, retryAt, deferLimit, flowKey, stagedAt

-- Read the completion whose values start at ARGV[first], for task hash
-- `key` and idempotency record `idem` (nil when the task has no key).
local function readCompletion(key, idem, flow, first)
  taskKey, idemKey, flowKey = key, idem, flow
  taskId, msgId = ARGV[first + C_TASK_ID], ARGV[first + C_MSG_ID]
  outcome = ARGV[first + C_OUTCOME]
  detail, log, now = ARGV[first + C_DETAIL], ARGV[first + C_LOG], ARGV[first + C_NOW]
  hasKey, digest = ARGV[first + C_HAS_KEY] == "1", ARGV[first + C_DIGEST]
  carriedAt = ARGV[first + C_CARRIED_AT]
  attempt, retryAt, deferLimit = "1", nil, nil
  local at = first + C_OPTIONAL
  if carriedAt == "" then
    attempt, at = ARGV[at], at + 1
  end
  stagedAt = nil
  if failed[outcome] then
    retryAt = ARGV[at]
  elseif outcome == "defer" then
    deferLimit = ARGV[at]
  elseif staging[outcome] then
    stagedAt = at
  end
end

-- The attempt's staged submissions into the task's flow (its outbox),
-- and the task into the flows index.
local function stage()
  local n = tonumber(ARGV[stagedAt])
  if n > 0 then
    for j = 1, n do
      local eid = rcall("HINCRBY", flowKey, "seq", 1)
      rcall("HSET", flowKey, "s:" .. eid, ARGV[stagedAt + j])
    end
    rcall("HINCRBY", flowKey, "staged", n)
  end
  rcall("PERSIST", flowKey)
  rcall("ZADD", flowsKey, now, taskId)
end

-- The common case first, with the least reading: a carried attempt that
-- succeeded (completion values from ARGV[first], task hash `key`,
-- idempotency record `idem`). It was the task's first, so there is no
-- earlier error to clear nor digests to append to. Any other state found
-- (its first beat wrote the attempt, or it is not this attempt's) takes
-- the full path: returns whether this one was written. It reads only
-- what it writes, into locals: `readCompletion` is for the full path.
local function carriedSuccess(key, idem, first)
  local msgId = ARGV[first + C_MSG_ID]
  local c = rcall("HMGET", key, "status", "msg_id", "attempts")
  if not carriedFirst(c[1], c[3], c[2], msgId) then
    return false
  end
  local taskId, now, log = ARGV[first + C_TASK_ID], ARGV[first + C_NOW], ARGV[first + C_LOG]
  local ran = ARGV[first + C_DIGEST]
  if ran == "" then
    ran = "-"
  end
  -- Each field the hash lacks costs a scan of it and an append: a
  -- handler that logged nothing adds no `log`, and `updated_at` stands for
  -- `finished_at`.
  if log == "" then
    rcall("HSET", key, "status", "SUCCEEDED", "attempts", "1", "updated_at", now,
      "result", ARGV[first + C_DETAIL], "digests", ran,
      "started_at", ARGV[first + C_CARRIED_AT])
  else
    rcall("HSET", key, "status", "SUCCEEDED", "attempts", "1", "updated_at", now,
      "log", log, "result", ARGV[first + C_DETAIL], "digests", ran,
      "started_at", ARGV[first + C_CARRIED_AT])
  end
  rcall("EXPIRE", key, retention)
  pushEvent(taskId, "SUCCEEDED", "1", now)
  if idem then
    setIdemState(idem, taskId, "completed", now)
  end
  acks[#acks + 1] = msgId
  return true
end

-- End a deferred task unrun, with `status` and `err`: the attempts it had
-- before this one (`before`).
local function endUnrun(before, status, err)
  rcall("HSET", taskKey, "status", status, "updated_at", now, "attempts", before,
    "error", err, "finished_at", now)
  rcall("EXPIRE", taskKey, retention)
  pushEvent(taskId, status, before, now)
  if hasKey then
    setIdemState(idemKey, taskId, "failed", now)
  end
  return 1, status
end

-- "defer": the attempt (the task's `attempts`th) is given back. Returns
-- the code and the task's status.
local function deferOne(attempts, cancelRequested)
  if msgId ~= "" then
    acks[#acks + 1] = msgId
  end
  local before = tonumber(attempts) - 1
  if cancelRequested then
    return endUnrun(before, "CANCELLED", "cancelled before it ran")
  end
  local limit = tonumber(deferLimit)
  local spent, since = string.match(rcall("HGET", taskKey, "deferred_since") or "",
    "^(%d+):(%d+)$")
  if tonumber(spent) ~= before then
    since = nil
  end
  if since and limit > 0 and tonumber(now) - tonumber(since) >= limit then
    local waited = tonumber(now) - tonumber(since)
    return endUnrun(before, "FAILED", string.format(
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

-- The status an attempt that ran ends its task with.
local function endStatus(attempts, maxAttempts, cancelRequested)
  if not failed[outcome] then
    return direct[outcome]
  elseif cancelRequested then
    return "CANCELLED"
  elseif tonumber(attempts) >= tonumber(maxAttempts) then
    return "DEAD_LETTERED"
  end
  return "RETRYING"
end

-- 1. The task hash to `status`, the attempt's digest appended to the
-- hash's `digests`; a retried attempt archived first.
local function writeHash(status, hadError, digests)
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
end

-- "wait": the attempt ends with the task WAITING for its children, or
-- resumed at once when its flow is already settled. Returns its status.
local function waitOne(attempts)
  local waits = rcall("HINCRBY", taskKey, "waits", 1)
  if waits > MAX_WAITS then
    outcome, detail = "fatal", string.format(
      "waited for its children %d times: a handler that waits whatever its children did " ..
      "would run forever (the wait asked with: %s)", MAX_WAITS, detail)
    return nil
  end
  local digests = rcall("HGET", taskKey, "digests")
  digest = digest ~= "" and digest or "-"
  rcall("HSET", taskKey, "status", "WAITING", "updated_at", now, "log", log,
    "digests", digests and (digests .. "," .. digest) or digest)
  -- It started: an expiry ("not started by") no longer applies, and its
  -- resumed run is the same attempt, not a retry to expire.
  rcall("HDEL", taskKey, "worker", "expires_at")
  stage()
  pushEvent(taskId, "WAITING", attempts, now)
  rcall("ZADD", waitingKey, now, taskId)
  if msgId ~= "" then
    acks[#acks + 1] = msgId
  end
  local resumed = resumeIfSettled(taskKey, flowKey, streamKey, waitingKey, taskId, now)
  if resumed then
    pushEvent(taskId, "QUEUED", resumed, now)
    return "QUEUED"
  end
  return "WAITING"
end

-- Steps 2 to 5 for a task that ended its attempt with `status`, counting
-- `attempts`.
local function followUp(status, attempts)
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
end

-- Complete the completion whose values start at ARGV[first] (see
-- `readCompletion`). Returns its code, the task's status, and its parent
-- when it has one and ended.
local function completeOne(key, idem, flow, first)
  readCompletion(key, idem, flow, first)
  local f = rcall("HMGET", taskKey, "status", "msg_id", "attempts", "max_attempts",
    "cancel_requested", "error", "digests", "parent")
  local current, attempts, maxAttempts, cancelRequested, hadError, digests =
    f[1], f[3] or "0", f[4] or "1", f[5] == "1", f[6], f[7]
  local parent = f[8]
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
    return deferOne(attempts, cancelRequested)
  end
  if began then
    rcall("HSET", taskKey, "attempts", "1", "started_at", began)
  end
  if outcome == "wait" then
    if cancelRequested then
      outcome, detail = "cancelled", "cancelled while running"
    else
      local status = waitOne(attempts)
      if status then
        return 1, status
      end
    end
  end
  local status = endStatus(attempts, maxAttempts, cancelRequested)
  writeHash(status, hadError, digests)
  followUp(status, attempts)
  if outcome == "staged" then
    stage()
  end
  if parent and status ~= "RETRYING" then
    rcall("ZADD", settleKey, now, taskId)
    return 1, status, parent
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
local idemAt, flowAt = 8 + count, 8 + count + keyed
for i = 1, count do
  local first, idemKey, flow = starts[i], nil, nil
  if ARGV[first + C_HAS_KEY] == "1" then
    idemKey, idemAt = KEYS[idemAt], idemAt + 1
  end
  local outcome = ARGV[first + C_OUTCOME]
  if outcome == "success" and ARGV[first + C_CARRIED_AT] ~= ""
      and carriedSuccess(KEYS[7 + i], idemKey, first) then
    out[i] = "SUCCEEDED"
  else
    if staging[outcome] then
      flow, flowAt = KEYS[flowAt], flowAt + 1
    end
    local code, status, parent = completeOne(KEYS[7 + i], idemKey, flow, first)
    -- An OK word is the status alone: no string is built for it.
    local word = code == 1 and status or code .. ":" .. status
    if parent then
      word = word .. "^" .. parent
    end
    out[i] = word
  end
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
