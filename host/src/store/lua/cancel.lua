--[[
  Cancel a task.

  A task that waits (QUEUED, SCHEDULED, RETRYING) becomes CANCELLED at once
  and never runs: it leaves the delayed set, and a worker that later reads
  its stream message only acknowledges it. A RUNNING task is flagged and its
  worker told on the cancel channel; the worker interrupts the sandbox and
  completes the task as CANCELLED.

  Input:
    KEYS[1] task hash            dtq:task:{q}:<id>
    KEYS[2] delayed set          dtq:delayed:{q}
    KEYS[3] events stream        dtq:events:{q}
    KEYS[4] idempotency record   dtq:idempotency:{q}:<key> (ignored unless ARGV[3] == "1")

    ARGV[1] task id
    ARGV[2] now (ms since epoch)
    ARGV[3] "1" when the task has an idempotency key
    ARGV[4] retention of terminal task hashes (s)
    ARGV[5] events stream max length
    ARGV[6] cancel channel       dtq:cancel:{q}
    ARGV[7] cancel channel message, `<queue>\n<task id>`
    ARGV[8] publish command: "PUBLISH", or "SPUBLISH" on a cluster (the
            channel's hash tag is the queue's, so it is this script's slot)
    ARGV[9] consumer group
    KEYS[5] ready stream         dtq:stream:{q}

  A QUEUED task whose message (`msg_id`) is pending in the group was
  delivered: its worker runs it, or is about to (a carried attempt, see
  ingest.lua, runs with no `start` to mark it RUNNING). It is treated as
  RUNNING. One whose message is not pending yet loses the message here, so
  that no worker reads it and the stream's length stays its depth.

  Output:
    {1, "CANCELLED"}        cancelled before it ran
    {3, "RUNNING"}          cancel requested; the worker will interrupt it
    {-5, status}            already terminal: nothing to cancel
    {-6, ""}                no such task

  Events: CANCELLED.
]]
local taskKey, delayedKey, eventsKey, idemKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local taskId, now, hasKey = ARGV[1], ARGV[2], ARGV[3] == "1"
local retention, eventsMaxLen, channel, message = tonumber(ARGV[4]), ARGV[5], ARGV[6], ARGV[7]
local publish = ARGV[8]

local streamKey, group = KEYS[5], ARGV[9]
local f = redis.call("HMGET", taskKey, "status", "attempts", "msg_id")
local status, msgId = f[1], f[3]
if not status then
  return {-6, ""}
end
local delivered = false
if status == "QUEUED" and msgId then
  delivered = pendingConsumer(streamKey, group, msgId) ~= false
  if not delivered then
    redis.call("XDEL", streamKey, msgId)
  end
end
if status == "RUNNING" or delivered then
  redis.call("HSET", taskKey, "cancel_requested", "1", "updated_at", now)
  redis.call(publish, channel, message)
  return {3, "RUNNING"}
end
if status ~= "QUEUED" and status ~= "SCHEDULED" and status ~= "RETRYING" then
  return {-5, status}
end
redis.call("HSET", taskKey, "status", "CANCELLED", "updated_at", now, "finished_at", now,
  "error", "cancelled before it ran")
redis.call("EXPIRE", taskKey, retention)
addEvent(eventsKey, eventsMaxLen, taskId, "CANCELLED", f[2] or "0", now)
redis.call("ZREM", delayedKey, taskId)
if hasKey then
  setIdemState(idemKey, taskId, "failed", now)
end
return {1, "CANCELLED"}
