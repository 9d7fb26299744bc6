--[[
  Cancel a task.

  A task that waits (QUEUED, SCHEDULED, RETRYING) becomes CANCELLED at once
  and never runs: it leaves the delayed set, and a worker that later reads
  its stream message only acknowledges it. A RUNNING task is flagged and its
  worker told on the cancel channel; the worker interrupts the sandbox and
  completes the task as CANCELLED. A WAITING task (flows) is cancelled at
  once too; its caller then cancels its children (store/flow.rs), and its
  flow stays in the flows index until they have all ended, for the sweeper
  to cancel any the caller did not reach (include/flow.lua). A task
  with a parent cancelled here joins the settle index, for the sweeper to
  tell its parent.

  Input:
    KEYS[1] task hash            dtq:task:{q}:<id>
    KEYS[2] delayed set          dtq:delayed:{q}
    KEYS[3] events stream        dtq:events:{q}
    KEYS[4] idempotency record   dtq:idempotency:{q}:<key> (ignored unless ARG_HAS_KEY)
    KEYS[5] ready stream         dtq:stream:{q}
    KEYS[6] settle index         dtq:settle:{q}
    KEYS[7] the task's flow      dtq:flow:{q}:<id>
    KEYS[8] flows index          dtq:flows:{q}
    KEYS[9] waiting set          dtq:waiting:{q}

    ARGV by name (the ARG_ locals below; store/cancel.rs, CANCEL_ARGV):
    ARG_TASK_ID         task id
    ARG_NOW             now (ms since epoch)
    ARG_HAS_KEY         "1" when the task has an idempotency key
    ARG_RETENTION       retention of terminal task hashes (s)
    ARG_EVENTS_MAX_LEN  events stream max length
    ARG_CHANNEL         cancel channel       dtq:cancel:{q}
    ARG_MESSAGE         cancel channel message, `<queue>\n<task id>`
    ARG_PUBLISH         publish command: "PUBLISH", or "SPUBLISH" on a
                        cluster (the channel's hash tag is the queue's, so
                        it is this script's slot)
    ARG_GROUP           consumer group

  A QUEUED task whose message (`msg_id`) is pending in the group was
  delivered: its worker runs it, or is about to (a carried attempt, see
  ingest.lua, runs with no `start` to mark it RUNNING). It is treated as
  RUNNING. One whose message is not pending yet loses the message here, so
  that no worker reads it and the stream's length stays its depth.

  Output:
    {1, "CANCELLED"}        cancelled before it ran, or while it waited for
                            its children
    {3, "RUNNING"}          cancel requested; the worker will interrupt it
    {-5, status}            already terminal: nothing to cancel
    {-6, ""}                no such task

  Events: CANCELLED.
]]
local ARG_TASK_ID = 1
local ARG_NOW = 2
local ARG_HAS_KEY = 3
local ARG_RETENTION = 4
local ARG_EVENTS_MAX_LEN = 5
local ARG_CHANNEL = 6
local ARG_MESSAGE = 7
local ARG_PUBLISH = 8
local ARG_GROUP = 9

local taskKey, delayedKey, eventsKey, idemKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local streamKey, settleKey, flowKey, flowsKey = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local waitingKey = KEYS[9]
local taskId, now, hasKey = ARGV[ARG_TASK_ID], ARGV[ARG_NOW], ARGV[ARG_HAS_KEY] == "1"
local retention, eventsMaxLen = tonumber(ARGV[ARG_RETENTION]), ARGV[ARG_EVENTS_MAX_LEN]
local channel, message, publish = ARGV[ARG_CHANNEL], ARGV[ARG_MESSAGE], ARGV[ARG_PUBLISH]
local group = ARGV[ARG_GROUP]

local f = redis.call("HMGET", taskKey, "status", "attempts", "msg_id", "parent")
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
if status ~= "QUEUED" and status ~= "SCHEDULED" and status ~= "RETRYING"
    and status ~= "WAITING" then
  return {-5, status}
end
local why = status == "WAITING" and "cancelled while waiting for its children"
  or "cancelled before it ran"
redis.call("HSET", taskKey, "status", "CANCELLED", "updated_at", now, "finished_at", now,
  "error", why)
redis.call("EXPIRE", taskKey, retention)
addEvent(eventsKey, eventsMaxLen, taskId, "CANCELLED", f[2] or "0", now)
redis.call("ZREM", delayedKey, taskId)
if hasKey then
  setIdemState(idemKey, taskId, "failed", now)
end
if f[4] then
  redis.call("ZADD", settleKey, now, taskId)
end
if status == "WAITING" then
  redis.call("ZREM", waitingKey, taskId)
  if not flowQuiet(taskKey, flowKey, flowsKey, taskId) then
    -- Its sweep looks may have backed off while it waited: the next comes
    -- soon, for the children its caller does not reach.
    redis.call("ZADD", flowsKey, "XX", now, taskId)
  end
end
return {1, "CANCELLED"}
