--[[
  Submit a task: replay check, stale-record repair, queue-depth check,
  idempotency claim, task hash, enqueue and index entry, in one atomic step.

  Because the whole check-and-claim is one script, a record cannot vanish
  between the claim and the read (the "expiry race" of a two-round-trip
  design): the script either sees the record or it does not.

  Input:
    KEYS[1] idempotency record  dtq:idempotency:{q}:<key> (ignored unless ARGV[3] == "1")
    KEYS[2] new task hash       dtq:task:{q}:<id>
    KEYS[3] ready stream        dtq:stream:{q}
    KEYS[4] delayed set         dtq:delayed:{q}
    KEYS[5] events stream       dtq:events:{q}
    KEYS[6] submission index    dtq:index:{q}
    KEYS[7] expiry index        dtq:expiry:{q} (touched only when ARGV[11] is set)
    KEYS[8] partition count     dtq:partitions:{q} (absent: 1)

    ARGV[1]  task id
    ARGV[2]  now (ms since epoch)
    ARGV[3]  "1" when the submission carries an idempotency key, else "0"
    ARGV[4]  payload fingerprint (sha256 of task name and canonical payload)
    ARGV[5]  idempotency TTL (s)
    ARGV[6]  max queue depth (ready + delayed); 0 means unlimited
    ARGV[7]  run at (ms since epoch); > now means the task is scheduled
    ARGV[8]  events stream max length
    ARGV[9]  prefix of task hashes of this queue, dtq:task:{q}:
    ARGV[10] oldest index entry to keep (ms since epoch: now minus the task
             retention), older entries trimmed (MINID ~, whole nodes); or ""
             not to trim this time (the host asks for a trim once in 16
             submissions to the queue: the trim's check alone costs about
             40% of the append)
    ARGV[11] expires_at (ms since epoch), or "" for a task without an expiry
    ARGV[12] the queue's partition count the submitter routed by
    ARGV[13] the head of what the stream message carries in its `run`
             field, its only one (the task id, the task name and what an
             attempt needs, see store/carried.rs), to which the payload is
             appended; "" for none: the message's one field is then `id`
    ARGV[14..] task hash fields as name, value pairs (status and msg_id are
             set here): attempts, updated_at, max_attempts, task and
             payload first, in that order, so the payload is ARGV[23]

  Output (array, first element the code):
    {1, id, status}                CREATED
    {2, id, task hash as list}     REPLAY (record completed or failed)
    {-1, id}                       IN_PROGRESS (record processing)
    {-2, id}                       KEY_MISMATCH (record of another payload)
    {-3, depth}                    QUEUE_FULL
    {-8, partitions}               REPARTITIONED (nothing written)
    {-9, partition}                FORWARDED: the key's records live in
                                   that partition (nothing written)

  Partitions: the submitter chose this partition (dtq:...:{q#i}) from the
  queue's partition count it knows. A raise writes the new count into every
  partition's slot, partition 0's last (store/partitions.rs); a submitter
  that routed by another count than this slot's is refused before anything
  is read, and routes again. So once any submitter routes by a new count,
  no submitter can write by the old one.

  Forwards: a DLQ requeue of a task whose key routes to another partition
  now leaves a forward in the key's partition (idem_forward.lua): the
  submitter sends the submission to the partition it names, where the
  task and its record live.

  Reads one key not in KEYS: the recorded task's hash, ARGV[9] .. task_id,
  to tell a live record from a stale one. It shares the queue's hash tag, so
  it lives in the same cluster slot as every other key here.

  Events: QUEUED or SCHEDULED on the events stream.

  Index: a new task (never a replay) is appended to the submission index,
  which the task listing reads newest first; when ARGV[10] is set the same
  XADD trims entries older than the retention.

  Expiry: a new task with an expiry is added to the expiry index by its
  expires_at, which the workers' sweep (expire.lua) reads. A task without
  an expiry costs nothing here.

  Carried tasks: a task that goes straight to the stream keeps its message
  id in the hash's `msg_id` (until a start overwrites it), so that a cancel
  or an expiry can delete the message. When ARGV[13] is set the message
  also carries the task itself, and a worker runs its first attempt from
  the message alone, with no `start` script: the hash stays QUEUED with
  attempts 0 while it runs, and a reader tells that attempt from its
  message pending in the group (see store/carried.rs). The host asks for it
  for every task that goes straight to the stream without an expiry. The
  message's `run` field is ARGV[13] followed by the payload, joined here:
  the payload is sent once, for the hash, rather than twice.
]]
local rcall = redis.call
local idemKey, taskKey, streamKey, delayedKey, eventsKey, indexKey =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local taskId, now, hasKey, fingerprint = ARGV[1], ARGV[2], ARGV[3] == "1", ARGV[4]
local idemTtl, maxDepth, runAt = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local eventsMaxLen, taskPrefix, indexMinId = ARGV[8], ARGV[9], ARGV[10]
local expiryKey, expiresAt = KEYS[7], ARGV[11]
local runHead = ARGV[13]

local partitions = tonumber(rcall("GET", KEYS[8]) or "1")
if partitions ~= tonumber(ARGV[12]) then
  return {-8, partitions}
end

-- Replay check: read-only, and before the depth check, so a full queue never
-- blocks a replay.
if hasKey then
  local raw = rcall("GET", idemKey)
  if raw then
    local rec = cjson.decode(raw)
    if rec["forward"] then
      return {-9, rec["forward"]}
    end
    local recordedKey = taskPrefix .. rec["task_id"]
    if rcall("EXISTS", recordedKey) == 1 then
      if rec["fingerprint"] ~= fingerprint then
        return {-2, rec["task_id"]}
      end
      if rec["state"] == "processing" then
        return {-1, rec["task_id"]}
      end
      return {2, rec["task_id"], rcall("HGETALL", recordedKey)}
    end
    -- Stale record: its task hash expired. The resubmission is new work.
    rcall("DEL", idemKey)
  end
end

if maxDepth > 0 then
  local depth = rcall("XLEN", streamKey) + rcall("ZCARD", delayedKey)
  if depth >= maxDepth then
    return {-3, depth}
  end
end

if hasKey then
  local rec = cjson.encode({
    task_id = taskId, state = "processing",
    updated_at = tonumber(now), fingerprint = fingerprint })
  rcall("SET", idemKey, rec, "NX", "EX", idemTtl)
end

local status = "QUEUED"
if runAt > tonumber(now) then
  status = "SCHEDULED"
end
if status == "SCHEDULED" then
  rcall("HSET", taskKey, "status", status, unpack(ARGV, 14))
  rcall("ZADD", delayedKey, runAt, taskId)
else
  local msgId
  if runHead ~= "" then
    msgId = rcall("XADD", streamKey, "*", "run", runHead .. ARGV[23])
  else
    msgId = rcall("XADD", streamKey, "*", "id", taskId)
  end
  rcall("HSET", taskKey, "status", status, "msg_id", msgId, unpack(ARGV, 14))
end
if expiresAt ~= "" then
  rcall("ZADD", expiryKey, expiresAt, taskId)
end
addEvent(eventsKey, eventsMaxLen, taskId, status, 0, now)
if indexMinId ~= "" then
  rcall("XADD", indexKey, "MINID", "~", indexMinId, "*", "id", taskId)
else
  rcall("XADD", indexKey, "*", "id", taskId)
end
return {1, taskId, status}
