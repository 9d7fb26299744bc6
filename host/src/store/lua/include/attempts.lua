--[[
  Shared fragment (complete, reclaim, requeue): the attempt history of a
  task, kept in its own hash.

  The task's last attempt lives in the hash's own fields (started_at,
  finished_at, error, log, the last entry of digests). An attempt that does
  not end the task (a retry, a lost attempt whose worker died) and the
  dead-lettered attempt a requeue leaves behind are archived as one field
  each, `attempt:<n>` = JSON {attempt, outcome, error, log, started_at,
  finished_at, digest} (absent values left out), so the next attempt can
  overwrite the hash's fields. The happy path (one attempt that succeeds)
  writes no such field.

  Bound: archiving attempt n drops attempt n - MAX_ATTEMPT_HISTORY, so a
  task keeps at most MAX_ATTEMPT_HISTORY archived attempts (attempt numbers
  are contiguous). An archived log is cut to ARCHIVED_LOG_MAX_BYTES (at a
  UTF-8 boundary, with a marker): the last attempt keeps its whole log in
  the hash's `log` field. The host mirrors both numbers
  (`store::task::MAX_ATTEMPT_HISTORY`, `ARCHIVED_LOG_MAX_BYTES`).
]]
local MAX_ATTEMPT_HISTORY = 20
local ARCHIVED_LOG_MAX_BYTES = 8192

-- `log` cut to ARCHIVED_LOG_MAX_BYTES at a UTF-8 character boundary.
local function archivedLog(log)
  if not log or #log <= ARCHIVED_LOG_MAX_BYTES then
    return log
  end
  local cut = ARCHIVED_LOG_MAX_BYTES
  -- Back off continuation bytes (10xxxxxx) so no character is split.
  while cut > 0 do
    local b = string.byte(log, cut + 1)
    if b < 128 or b >= 192 then
      break
    end
    cut = cut - 1
  end
  return string.sub(log, 1, cut) .. "\n[log cut to " .. cut .. " of " .. #log ..
    " bytes in the attempt history]"
end

-- Archive attempt `n` (a number) of the task at `taskKey`; "" and false
-- values are left out of the record.
local function archiveAttempt(taskKey, n, outcome, err, log, startedAt, finishedAt, digest)
  local function present(v)
    if v == false or v == "" then
      return nil
    end
    return v
  end
  local record = {
    attempt = n,
    outcome = outcome,
    error = present(err),
    log = archivedLog(present(log)),
    started_at = tonumber(present(startedAt) or ""),
    finished_at = tonumber(present(finishedAt) or ""),
    digest = digest ~= "-" and present(digest) or nil,
  }
  redis.call("HSET", taskKey, "attempt:" .. n, cjson.encode(record))
  if n > MAX_ATTEMPT_HISTORY then
    redis.call("HDEL", taskKey, "attempt:" .. (n - MAX_ATTEMPT_HISTORY))
  end
end

-- The last entry of a task's `digests` field (comma-separated), or nil.
local function lastDigest(digests)
  if not digests then
    return nil
  end
  return string.match(digests, "([^,]*)$")
end
