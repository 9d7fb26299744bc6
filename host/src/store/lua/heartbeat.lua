--[[
  Keep a worker's running messages from being reclaimed, and report which of
  its tasks were asked to cancel (in case the cancel channel message was
  missed, e.g. across a reconnect).

  XCLAIM of a message by its own consumer with min-idle-time 0 resets its
  idle time; other workers reclaim only messages idle for longer than the
  visibility timeout, so a live worker keeps every task it runs. A message
  whose task another worker has taken over meanwhile (its hash names another
  worker or message) is left alone: claiming it back would only make two
  owners. That worker's run is the task's; this one's completion will be
  refused as stale.

  Input:
    KEYS[1] ready stream   dtq:stream:{q}
    KEYS[2..] the task hash of each message in ARGV[3..], in order

    ARGV[1] consumer group
    ARGV[2] consumer (worker) name
    ARGV[3..] stream message ids

  Output: the message ids (of those given and still this worker's) whose
  task has a cancel request.
]]
local streamKey, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local claim = {"XCLAIM", streamKey, group, consumer, 0}
local cancelled = {}
for i = 2, #KEYS do
  local msgId = ARGV[i + 1]
  local f = redis.call("HMGET", KEYS[i], "worker", "msg_id", "cancel_requested")
  if f[1] == consumer and f[2] == msgId then
    claim[#claim + 1] = msgId
    if f[3] == "1" then
      cancelled[#cancelled + 1] = msgId
    end
  end
end
if #claim > 5 then
  claim[#claim + 1] = "JUSTID"
  redis.call(unpack(claim))
end
return cancelled
