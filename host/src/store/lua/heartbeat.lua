--[[
  A worker's heartbeat on one queue, every third of the visibility timeout
  whether or not it runs anything: it stamps the worker alive, keeps its
  running messages, and tells it which of its attempts were asked to cancel
  and which are stale.

  1. The queue's liveness clock ticks (include/liveness.lua).
  2. The worker's stamp in the workers set becomes Redis's time: while it
     is within the visibility timeout, no other worker reclaims its
     messages (reclaim.lua).
  3. For each running attempt, the task hash tells whether it is still this
     attempt's: it names this worker, this message and this attempt. If so,
     and its message is pending on this worker, XCLAIM by its own consumer
     with min-idle-time 0 resets the message's idle time (reclaim looks only
     at messages idle longer than the visibility timeout). A message pending
     on another worker is not claimed back: that worker took it over, and
     its attempt is about to start. An attempt whose task hash names another
     worker, message or attempt (or is gone) was reclaimed elsewhere: it is
     stale, its completion would be refused, and the worker stops it.
     A carried first attempt (ingest.lua), which no `start` wrote, is
     this attempt's while the hash is QUEUED with attempts 0 and names its
     message. Its first beat, with the message pending on this worker,
     writes the attempt as `start` would have (RUNNING, attempt 1, this
     worker, started when the message was delivered): an attempt that
     outlives a beat then looks like any other to readers, reclaim and its
     completion. One that ends sooner never costs this write.
     A task key that is not a hash is no attempt's: STALE.

  Input:
    KEYS[1] ready stream   dtq:stream:{q}
    KEYS[2] workers set    dtq:workers:{q}   consumer -> last beat (ms, Redis's clock)
    KEYS[3] clock hash     dtq:clock:{q}     last, resumed (ms, Redis's clock)
    KEYS[4..] the task hash of each running attempt, dtq:task:{q}:<id>

    ARGV by name (the ARG_ locals below; store/start.rs, HEARTBEAT_ARGV):
    ARG_GROUP       consumer group
    ARG_CONSUMER    consumer (worker) name
    ARG_VISIBILITY  visibility timeout (ms)
    then from ARG_ATTEMPTS, per task hash k (from 0), in the same order:
      the attempt's stream message id, the attempt's number

  Output: one code per attempt, in order:
    1    OK: still this attempt's
    3    CANCEL_REQUESTED: still this attempt's, and its task was asked to
         cancel (in case the cancel channel message was missed, e.g.
         across a reconnect)
    -4   STALE: the task is no longer this attempt's
]]
local ARG_GROUP = 1
local ARG_CONSUMER = 2
local ARG_VISIBILITY = 3
local ARG_ATTEMPTS = 4

local streamKey, workersKey, clockKey = KEYS[1], KEYS[2], KEYS[3]
local group, consumer = ARGV[ARG_GROUP], ARGV[ARG_CONSUMER]
local visibility = tonumber(ARGV[ARG_VISIBILITY])

local now = redisTimeMs()
tickClock(clockKey, now, visibility)
redis.call("ZADD", workersKey, string.format("%d", now), consumer)

local claim = { "XCLAIM", streamKey, group, consumer, 0 }
local out = {}
for i = 4, #KEYS do
  local a = ARG_ATTEMPTS + 2 * (i - 4)
  local msgId, attempt = ARGV[a], ARGV[a + 1]
  -- pcall: a task key of another type (corrupt) is not this attempt's;
  -- an error would stop every beat of this worker, which would look dead.
  local f = redis.pcall("HMGET", KEYS[i], "worker", "msg_id", "attempts", "cancel_requested",
    "status")
  if f.err then
    f = {}
  end
  local mine = f[1] == consumer and f[3] == attempt
  local carried = not mine and attempt == "1" and carriedFirst(f[5], f[3], f[2], msgId)
  if (mine or carried) and f[2] == msgId then
    local pending = redis.call("XPENDING", streamKey, group, msgId, msgId, 1, consumer)[1]
    if pending then
      claim[#claim + 1] = msgId
      if carried then
        -- Its first beat: write the attempt as start would have, started
        -- when the message was delivered (no claim has reset its idle time
        -- before this beat's).
        redis.call("HSET", KEYS[i], "status", "RUNNING", "attempts", "1", "worker", consumer,
          "started_at", string.format("%d", now - pending[3]),
          "updated_at", string.format("%d", now))
      end
    end
    out[#out + 1] = f[4] == "1" and 3 or 1
  else
    out[#out + 1] = -4
  end
end
if #claim > 5 then
  claim[#claim + 1] = "JUSTID"
  redis.call(unpack(claim))
end
return out
