--[[
  Add a queue to the registry of queue names, within its bound.

  The registry (dtq:queues) lists the queues that have seen a submission,
  for GET /v1/queues and the queue-depth metrics; any submitter that may
  submit to a new name adds one, so it is bounded (--max-queues): a new
  name past the bound is refused, and so is its submission, before
  anything is written. It is the one key without a queue's hash tag, and
  the only key here, so the script runs in its own slot on a cluster.

  Input:
    KEYS[1] the registry   dtq:queues

    ARGV by name (the ARG_ locals below; store/mod.rs,
    QUEUE_REGISTER_ARGV):
    ARG_QUEUE  the queue's name
    ARG_MAX    the most names the registry may hold

  Output: 1 when the name is in the registry (now or already), 0 when it is
  not and the registry is full.
]]
local ARG_QUEUE = 1
local ARG_MAX = 2

local registry, queue, max = KEYS[1], ARGV[ARG_QUEUE], tonumber(ARGV[ARG_MAX])
if redis.call("SISMEMBER", registry, queue) == 1 then
  return 1
end
if redis.call("SCARD", registry) >= max then
  return 0
end
redis.call("SADD", registry, queue)
return 1
