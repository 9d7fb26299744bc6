--[[
  Shared fragment: a parent's flow, and its resumption once settled.

  A task that submits tasks or waits for children has a flow hash,
  dtq:flow:{q}:<id>, in its own slot (store/flow.rs):
    s:<eid>     a staged submission not applied yet (JSON; the outbox)
    staged      how many s: fields there are
    c:<ref>     a child, by "<queue>/<id>", valued by its position
    seq         the last position given
    children    how many c: fields there are
    d:<ref>     a child seen terminal
    settled     how many d: fields there are
    r:<ref>     why a child's submission was refused (it never runs)
    waits       (in the task's hash) how many times it waited
  A `d:` may come before its `c:` (a child that ended before its parent
  recorded it); the counts meet once both are written.

  A WAITING task is also in its queue's waiting set, dtq:waiting:{q} (by
  when it began to wait): the count of waiting parents. complete.lua adds
  it as it waits; it leaves as it resumes or is cancelled (cancel.lua).

  `resumeIfSettled` resumes a WAITING parent whose flow is settled (no
  staged submission, every child terminal): back to QUEUED with a new
  stream message, its `attempts` one less, so that the run `start.lua`
  begins is the same attempt again, not a new one. Returns the attempts
  it now counts when it resumed the parent (the caller writes the QUEUED
  event), else false.
]]
local function flowSettled(flowKey)
  local f = redis.call("HMGET", flowKey, "staged", "children", "settled")
  return tonumber(f[1] or "0") <= 0 and tonumber(f[3] or "0") >= tonumber(f[2] or "0")
end

local function resumeIfSettled(taskKey, flowKey, streamKey, waitingKey, taskId, now)
  if redis.call("HGET", taskKey, "status") ~= "WAITING" or not flowSettled(flowKey) then
    return false
  end
  redis.call("ZREM", waitingKey, taskId)
  local attempts = redis.call("HINCRBY", taskKey, "attempts", -1)
  local msgId = redis.call("XADD", streamKey, "*", "id", taskId)
  redis.call("HSET", taskKey, "status", "QUEUED", "updated_at", now, "msg_id", msgId)
  return attempts
end

-- The statuses a task ends in.
local FLOW_TERMINAL = { SUCCEEDED = true, FAILED = true, CANCELLED = true, EXPIRED = true,
  DEAD_LETTERED = true }

-- A flow whose task has ended with nothing staged leaves the queue's index
-- of flows (the sweeper's work list) and expires with its task (a
-- dead-lettered task's, kept until purged, stays). A cancelled task takes
-- its children with it: its flow stays until every child has ended, so
-- that the sweeper cancels those its canceller did not reach (an API
-- process that died part-way; ingest/flow.rs, `repair`). Returns whether
-- it left.
local function flowQuiet(taskKey, flowKey, flowsKey, taskId)
  local status = redis.call("HGET", taskKey, "status")
  if status and not FLOW_TERMINAL[status] then
    return false
  end
  if status == "CANCELLED" and not flowSettled(flowKey) then
    return false
  end
  if tonumber(redis.call("HGET", flowKey, "staged") or "0") > 0 then
    return false
  end
  redis.call("ZREM", flowsKey, taskId)
  local ttl = redis.call("TTL", taskKey)
  if ttl > 0 then
    redis.call("EXPIRE", flowKey, ttl)
  elseif ttl == -2 then
    redis.call("DEL", flowKey)
  end
  return true
end
