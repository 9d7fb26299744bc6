--[[
  Shared fragment: the one statement of whether a carried first attempt
  runs (store/carried.rs), and of which task a stream message names
  (`messageTaskId`). No `start` wrote it, so two things say it
  together: the task hash is QUEUED with no attempt counted and names the
  message (`carriedFirst`), and that message is pending in the group, on
  the consumer that runs it (`pendingConsumer`).
]]

-- Whether a task hash's `status`, `attempts` and `msg_id` (`hashMsgId`)
-- are those of a carried first attempt delivered as message `msgId`.
local function carriedFirst(status, attempts, hashMsgId, msgId)
  return status == "QUEUED" and (attempts or "0") == "0" and hashMsgId == msgId
end

-- The consumer message `msgId` of `streamKey` is pending on in `group`,
-- or false when it is not delivered. No group yet (no worker has read the
-- queue): nothing is delivered.
local function pendingConsumer(streamKey, group, msgId)
  local p = redis.pcall("XPENDING", streamKey, group, msgId, msgId, 1)
  if type(p) == "table" and not p.err and p[1] then
    return p[1][2]
  end
  return false
end

-- The task a stream message names, from its body (name, value, ...), as
-- the worker reads it (store/carried.rs, `task_id`): its `id` field, else
-- the first line of its `run` field; nil for a message that names none.
local function messageTaskId(body)
  local run
  for i = 1, #body, 2 do
    if body[i] == "id" then
      return body[i + 1]
    elseif body[i] == "run" and not run then
      run = body[i + 1]
    end
  end
  return run and string.match(run, "^([^\n]+)\n")
end
