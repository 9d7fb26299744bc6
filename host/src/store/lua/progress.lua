--[[
  Write a running attempt's progress, as its handler reported it
  (sandbox/progress.rs, through store/progress.rs): only while the task
  runs that attempt, so that a write that arrives late never lands on a
  task that completed, or on a reclaimed task's next attempt.

  The attempt runs when the hash is RUNNING with its number, or, for a
  carried first attempt (store/carried.rs), which no `start` marked, when
  the hash is QUEUED with no attempt counted, names a message, and that
  message is pending in the group (include/carried.lua). A task with an
  expiry is never carried. A hash that is gone, or not a hash, is no
  attempt's: nothing is written.

  Input:
    KEYS[1] ready stream   dtq:stream:{q}
    KEYS[2] events stream  dtq:events:{q}
    KEYS[3] task hash      dtq:task:{q}:<id>

    ARGV by name (the ARG_ locals below; store/progress.rs, PROGRESS_ARGV):
    ARG_GROUP           consumer group
    ARG_TASK_ID         the task id (for the event)
    ARG_ATTEMPT         the attempt that reports
    ARG_FRACTION        how far it is, 0 to 1 (decimal text)
    ARG_MESSAGE         its message
    ARG_AT              when the handler reported it (ms since epoch)
    ARG_EVENTS_MAX_LEN  events stream max length; 0 writes no event

  Output: 1 written, 0 not (the task does not run this attempt).

  Writes: field `progress` of the task hash, JSON {fraction, message,
  updated_at, attempt}; nothing else of the hash changes (`updated_at`
  stays the time of its last status change).

  Events: PROGRESS, with the fields `fraction` and `message` beside the
  usual four, unless ARG_EVENTS_MAX_LEN is 0.
]]
local ARG_GROUP = 1
local ARG_TASK_ID = 2
local ARG_ATTEMPT = 3
local ARG_FRACTION = 4
local ARG_MESSAGE = 5
local ARG_AT = 6
local ARG_EVENTS_MAX_LEN = 7

local streamKey, eventsKey, taskKey = KEYS[1], KEYS[2], KEYS[3]
local attempt = ARGV[ARG_ATTEMPT]

-- pcall: a key of another type is no attempt's.
local f = redis.pcall("HMGET", taskKey, "status", "attempts", "msg_id", "expires_at")
if f.err then
  return 0
end
local runs = f[1] == "RUNNING" and f[2] == attempt
if not runs and attempt == "1" and f[3] and not f[4] and carriedFirst(f[1], f[2], f[3], f[3]) then
  runs = pendingConsumer(streamKey, ARGV[ARG_GROUP], f[3]) ~= false
end
if not runs then
  return 0
end

redis.call("HSET", taskKey, "progress", cjson.encode({
  fraction = tonumber(ARGV[ARG_FRACTION]),
  message = ARGV[ARG_MESSAGE],
  updated_at = tonumber(ARGV[ARG_AT]),
  attempt = tonumber(attempt),
}))
local maxLen = ARGV[ARG_EVENTS_MAX_LEN]
if maxLen ~= "0" then
  redis.call("XADD", eventsKey, "MAXLEN", "~", maxLen, "*",
    "task_id", ARGV[ARG_TASK_ID], "status", "PROGRESS", "attempt", attempt,
    "at", ARGV[ARG_AT], "fraction", ARGV[ARG_FRACTION], "message", ARGV[ARG_MESSAGE])
end
return 1
