--[[
  Forward an idempotency key to the partition that holds its task, before a
  DLQ requeue of that task (store/dlq.rs).

  A keyed submission looks for its key's record in the partition the key
  routes to now (and, for a while after a raise, where replaced counts
  routed it: store/partitions.rs). A task requeued after a raise may live
  in another partition than the one its key routes to now, and its record
  must live beside it, where the completion, cancel and purge scripts keep
  it in one atomic step with the task. So the key's home partition gets a
  forward instead: {forward, task_id, updated_at}, which sends keyed
  submissions (ingest.lua, code FORWARDED) and lookups to the task's
  partition. Each script touches one slot; the host writes the forward
  first and requeues after, so no submission can create a second task for
  the key between the two: once the forward is written every submission of
  the key meets the requeued task's record (or its absence, and then the
  requeue finds the new task and refuses).

  Input:
    KEYS[1] idempotency record in the key's home partition
            dtq:idempotency:{q#h}:<key>

    ARGV by name (the ARG_ locals below; store/dlq.rs, IDEM_FORWARD_ARGV):
    ARG_TASK_ID      the task's id (of partition ARG_PARTITION)
    ARG_PARTITION    the task's partition
    ARG_TASK_PREFIX  prefix of task hashes of the home partition,
                     dtq:task:{q#h}: (read, although not in KEYS, in this
                     slot: see include/idem.lua)
    ARG_NOW          now (ms since epoch)
    ARG_TTL          the forward's TTL (s): the idempotency TTL and a
                     margin, so that it outlives the record the requeue
                     may recreate after it

  Output:
    {1, ""}      forwarded (a forward to this task was written or renewed)
    {-10, id}    the key names task `id` of this partition (or forwards to
                 another task): nothing written; the requeue is refused
]]
local ARG_TASK_ID = 1
local ARG_PARTITION = 2
local ARG_TASK_PREFIX = 3
local ARG_NOW = 4
local ARG_TTL = 5

local idemKey = KEYS[1]
local taskId, partition = ARGV[ARG_TASK_ID], tonumber(ARGV[ARG_PARTITION])
local taskPrefix = ARGV[ARG_TASK_PREFIX]
local other = idemTakenBy(idemKey, taskId, taskPrefix)
if other then
  return {-10, other}
end
redis.call("SET", idemKey, cjson.encode({
  forward = partition, task_id = taskId, updated_at = tonumber(ARGV[ARG_NOW]) }),
  "EX", ARGV[ARG_TTL])
return {1, ""}
