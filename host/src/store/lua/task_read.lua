--[[
  Read tasks of one queue (partition): each one's hash, and the worker
  running its carried first attempt, if one is (store/carried.rs).

  A carried attempt runs with no `start` to mark it: the hash stays QUEUED
  with attempts 0, naming its message (`msg_id`), and the message pending
  in the group says which worker runs it. Read here in one step with the
  hash, so a reader never pairs a hash from before a completion with the
  group from after it.

  Input:
    KEYS[1] ready stream   dtq:stream:{q}
    KEYS[2..] task hashes  dtq:task:{q}:<id>

    ARGV by name (the ARG_ locals below; store/task_read.rs, TASK_READ_ARGV):
    ARG_GROUP   consumer group
    then from ARG_FIELDS, the fields to read (HMGET); none for the whole
    hash (HGETALL)

  Output: one flat array, two values per task in order: its fields (as
  HMGET or HGETALL answer), and the consumer running its carried first
  attempt, or nil.
]]
local ARG_GROUP = 1
local ARG_FIELDS = 2

local streamKey, group = KEYS[1], ARGV[ARG_GROUP]
local out = {}
for i = 2, #KEYS do
  local fields
  if #ARGV >= ARG_FIELDS then
    fields = redis.call("HMGET", KEYS[i], unpack(ARGV, ARG_FIELDS))
  else
    fields = redis.call("HGETALL", KEYS[i])
  end
  local f = redis.call("HMGET", KEYS[i], "status", "attempts", "msg_id", "expires_at")
  local runner = false
  -- A task with an expiry is never carried: `start` checks the expiry.
  if f[3] and carriedFirst(f[1], f[2], f[3], f[3]) and not f[4] then
    runner = pendingConsumer(streamKey, group, f[3])
  end
  out[2 * i - 3], out[2 * i - 2] = fields, runner
end
return out
