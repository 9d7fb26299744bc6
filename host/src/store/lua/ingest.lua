--[[
  Submit a task: replay check, stale-record repair, queue-depth check,
  idempotency claim, task hash, enqueue and index entry, in one atomic step.

  Because the whole check-and-claim is one script, a record cannot vanish
  between the claim and the read (the "expiry race" of a two-round-trip
  design): the script either sees the record or it does not.

  Input:
    KEYS[1] idempotency record  dtq:idempotency:{q}:<key> (ignored unless HAS_KEY)
    KEYS[2] new task hash       dtq:task:{q}:<id>
    KEYS[3] ready stream        dtq:stream:{q}
    KEYS[4] delayed set         dtq:delayed:{q}
    KEYS[5] events stream       dtq:events:{q}
    KEYS[6] submission index    dtq:index:{q}
    KEYS[7] expiry index        dtq:expiry:{q} (touched only when EXPIRES_AT is set)
    KEYS[8] partition count     dtq:partitions:{q} (absent: 1)

    ARGV by name: each name below is a local of this script holding its
    index, and a constant of the same name and value in store/submit.rs
    (`argv`), where the host builds them, each at its name's index; a test
    there holds the two lists to each other.
    TASK_ID (1)         task id
    NOW (2)             now (ms since epoch)
    HAS_KEY (3)         "1" when the submission carries an idempotency key,
                        else "0"
    FINGERPRINT (4)     payload fingerprint (sha256 of task name and
                        canonical payload)
    IDEM_TTL (5)        idempotency TTL (s)
    MAX_DEPTH (6)       max queue depth (ready + delayed); 0 means unlimited
    RUN_AT (7)          run at (ms since epoch); > now means the task is
                        scheduled
    EVENTS_MAX_LEN (8)  events stream max length
    TASK_PREFIX (9)     prefix of task hashes of this queue, dtq:task:{q}:
    INDEX_MIN_ID (10)   oldest index entry to keep (ms since epoch: now
                        minus the task retention), older entries trimmed
                        (MINID ~, whole nodes); or "" not to trim this time
                        (the host asks for a trim once in 16 submissions to
                        the queue: the trim's check alone costs about 40% of
                        the append)
    EXPIRES_AT (11)     expires_at (ms since epoch), or "" for a task without
                        an expiry
    PARTITIONS (12)     the queue's partition count the submitter routed by
    RUN_HEAD (13)       the head of what the stream message carries in its
                        `run` field, its only one (the task id, the task
                        name and what an attempt needs, see
                        store/carried.rs), to which the payload is appended;
                        "" for none: the message's one field is then `id`
    TRACEPARENT (14)    the submission's W3C traceparent, or "" for none
                        (the host sends one only when tracing is on or the
                        submitter sent one); a carried message carries it
                        in a field of that name, the hash in its field
                        among FIELDS
    FIELDS (15)         from here to the end, the task hash's fields as
                        name, value pairs (status and msg_id are set here):
                        attempts, updated_at, max_attempts, task and payload
                        first, in that order (the host's LEADING_FIELDS)
    PAYLOAD (24)        the payload: the value of the fifth pair, `payload`

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

  Reads one key not in KEYS: the recorded task's hash, TASK_PREFIX .. task_id,
  to tell a live record from a stale one. It shares the queue's hash tag, so
  it lives in the same cluster slot as every other key here.

  Events: QUEUED or SCHEDULED on the events stream.

  Index: a new task (never a replay) is appended to the submission index,
  which the task listing reads newest first; when INDEX_MIN_ID is set the same
  XADD trims entries older than the retention.

  Expiry: a new task with an expiry is added to the expiry index by its
  expires_at, which the workers' sweep (expire.lua) reads. A task without
  an expiry costs nothing here.

  Carried tasks: a task that goes straight to the stream keeps its message
  id in the hash's `msg_id` (until a start overwrites it), so that a cancel
  or an expiry can delete the message. When RUN_HEAD is set the message
  also carries the task itself, and a worker runs its first attempt from
  the message alone, with no `start` script: the hash stays QUEUED with
  attempts 0 while it runs, and a reader tells that attempt from its
  message pending in the group (see store/carried.rs). The host asks for it
  for every task that goes straight to the stream without an expiry. The
  message's `run` field is RUN_HEAD followed by the payload, joined here:
  the payload is sent once, for the hash, rather than twice. A traced
  submission's carried message has a second field, `traceparent`, which a
  worker reads with the task (an older worker ignores it).
]]
local rcall = redis.call

-- ARGV by name (see the header; store/submit.rs builds them).
local TASK_ID = 1
local NOW = 2
local HAS_KEY = 3
local FINGERPRINT = 4
local IDEM_TTL = 5
local MAX_DEPTH = 6
local RUN_AT = 7
local EVENTS_MAX_LEN = 8
local TASK_PREFIX = 9
local INDEX_MIN_ID = 10
local EXPIRES_AT = 11
local PARTITIONS = 12
local RUN_HEAD = 13
local TRACEPARENT = 14
local FIELDS = 15
local PAYLOAD = 24

local idemKey, taskKey, streamKey, delayedKey, eventsKey, indexKey =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local expiryKey, partitionsKey = KEYS[7], KEYS[8]
local taskId, now, hasKey = ARGV[TASK_ID], ARGV[NOW], ARGV[HAS_KEY] == "1"
-- Values Redis takes as they came: a number passed to `redis.call` is
-- turned back into a string with `sprintf`.
local fingerprint, idemTtl = ARGV[FINGERPRINT], ARGV[IDEM_TTL]
local maxDepth, runAt = tonumber(ARGV[MAX_DEPTH]), tonumber(ARGV[RUN_AT])
local eventsMaxLen, taskPrefix = ARGV[EVENTS_MAX_LEN], ARGV[TASK_PREFIX]
local indexMinId, expiresAt = ARGV[INDEX_MIN_ID], ARGV[EXPIRES_AT]
local runHead, traceparent = ARGV[RUN_HEAD], ARGV[TRACEPARENT]

local partitions = tonumber(rcall("GET", partitionsKey) or "1")
if partitions ~= tonumber(ARGV[PARTITIONS]) then
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
  rcall("SET", idemKey, idemRecord(taskId, "processing", now, fingerprint), "NX", "EX", idemTtl)
end

local status = "QUEUED"
if runAt > tonumber(now) then
  status = "SCHEDULED"
end
if status == "SCHEDULED" then
  rcall("HSET", taskKey, "status", status, unpack(ARGV, FIELDS))
  rcall("ZADD", delayedKey, runAt, taskId)
else
  local msgId
  if runHead ~= "" and traceparent ~= "" then
    msgId = rcall("XADD", streamKey, "*", "run", runHead .. ARGV[PAYLOAD],
      "traceparent", traceparent)
  elseif runHead ~= "" then
    msgId = rcall("XADD", streamKey, "*", "run", runHead .. ARGV[PAYLOAD])
  else
    msgId = rcall("XADD", streamKey, "*", "id", taskId)
  end
  rcall("HSET", taskKey, "status", status, "msg_id", msgId, unpack(ARGV, FIELDS))
end
if expiresAt ~= "" then
  rcall("ZADD", expiryKey, expiresAt, taskId)
end
addEvent(eventsKey, eventsMaxLen, taskId, status, "0", now)
if indexMinId ~= "" then
  rcall("XADD", indexKey, "MINID", "~", indexMinId, "*", "id", taskId)
else
  rcall("XADD", indexKey, "*", "id", taskId)
end
return {1, taskId, status}
