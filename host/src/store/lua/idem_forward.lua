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

    ARGV[1] the task's id (of partition ARGV[2])
    ARGV[2] the task's partition
    ARGV[3] prefix of task hashes of the home partition, dtq:task:{q#h}:
            (read, although not in KEYS, in this slot: see include/idem.lua)
    ARGV[4] now (ms since epoch)
    ARGV[5] the forward's TTL (s): the idempotency TTL and a margin, so
            that it outlives the record the requeue may recreate after it

  Output:
    {1, ""}      forwarded (a forward to this task was written or renewed)
    {-10, id}    the key names task `id` of this partition (or forwards to
                 another task): nothing written; the requeue is refused
]]
local idemKey, taskId, partition, taskPrefix = KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[3]
local other = idemTakenBy(idemKey, taskId, taskPrefix)
if other then
  return {-10, other}
end
redis.call("SET", idemKey, cjson.encode({
  forward = partition, task_id = taskId, updated_at = tonumber(ARGV[4]) }),
  "EX", ARGV[5])
return {1, ""}
