--[[
  Shared fragment (heartbeat, reclaim), after include/clock.lua: a
  queue's liveness clock.

  A worker is alive while it has beaten within the visibility timeout, by
  Redis's clock: the stamps come from TIME in the script, never from a
  worker's clock. An outage (Redis stopped, hung or restarting) stops every
  worker's beats at once, and would make every live worker look dead the
  moment Redis is back. So each queue keeps a clock, dtq:clock:{q}, ticked
  by every heartbeat and reclaim script on the queue:
    last      Redis's time (ms) of the last tick
    resumed   Redis's time (ms) the clock last resumed after a gap
  Live workers beat every third of the visibility timeout, so a gap of more
  than half of it since `last` (or no clock yet, or a clock that went
  back) is an outage: the clock resumes at once, and nobody counts as dead
  until it has run a whole visibility timeout since, long enough for every
  live worker to beat again. A worker that is truly dead is then reclaimed
  one visibility timeout after Redis is back.
]]

-- Tick the clock `clockKey` at `now` (ms); returns when it last resumed.
local function tickClock(clockKey, now, visibility)
  local c = redis.call("HMGET", clockKey, "last", "resumed")
  local last, resumed = tonumber(c[1]), tonumber(c[2])
  local stamp = string.format("%d", now)
  if not last or not resumed or now < last or now - last > visibility / 2 then
    resumed = now
    redis.call("HSET", clockKey, "last", stamp, "resumed", stamp)
  else
    redis.call("HSET", clockKey, "last", stamp)
  end
  return resumed
end
