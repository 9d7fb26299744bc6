--[[
  Keep a worker's running messages from being reclaimed, and report which of
  its tasks were asked to cancel (in case the cancel channel message was
  missed, e.g. across a reconnect).

  XCLAIM of a message by its own consumer with min-idle-time 0 resets its
  idle time; other workers reclaim only messages idle for longer than the
  visibility timeout, so a live worker keeps every task it runs.

  Input:
    KEYS[1] ready stream   dtq:stream:{q}
    KEYS[2..] the task hash of each message in ARGV[3..], in order

    ARGV[1] consumer group
    ARGV[2] consumer (worker) name
    ARGV[3..] stream message ids

  Output: the message ids (of those given) whose task has a cancel request.
]]
local streamKey, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local args = {"XCLAIM", streamKey, group, consumer, 0}
for i = 3, #ARGV do
  args[#args + 1] = ARGV[i]
end
if #args > 5 then
  args[#args + 1] = "JUSTID"
  redis.call(unpack(args))
end
local cancelled = {}
for i = 2, #KEYS do
  if redis.call("HGET", KEYS[i], "cancel_requested") == "1" then
    cancelled[#cancelled + 1] = ARGV[i + 1]
  end
end
return cancelled
