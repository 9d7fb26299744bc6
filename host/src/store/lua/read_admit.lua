--[[
  Read up to COUNT new messages of a queue with limits for a consumer and
  admit them (include/admission.lua) in one step: the fetch loop's read of
  a queue with limits. A read then an `admit` would keep a batch's slots
  idle for the second round trip before it starts; here the batch starts
  as soon as the read's reply arrives, as one without limits does. The
  blocking wait of an idle worker still reads with XREADGROUP … BLOCK
  (no script blocks) and admits what it delivered with `admit.lua`.

  Each message is decided as `admit.lua` decides it: the admitted ones are
  returned, pending on the consumer as any message read; the held ones
  are out of the stream already. Its task is named only when the
  decision needs it (not within a rate window's count), by
  `messageTaskId` (include/carried.lua), as the worker names it. A
  message that names none is returned as read and never held (the worker
  skips it, as from any read).

  The reply is one flat array: Redis converts each table of a script's
  reply on its own, a cost per table, so the entries are not returned as
  XREADGROUP's nested ones.

  If the reply is lost, the admitted messages are pending on the consumer
  with the rate window charged for them; the worker reads them back and
  `admit.lua` admits them again, charging the window a second time (a
  group slot is not taken twice). A lost reply can only slow the queue.

  Input:
    KEYS[1..3] as include/admission.lua

    ARGV by name (the ARG_ locals; store/limits.rs, READ_ADMIT_ARGV):
    those of include/admission.lua, then
    ARG_CONSUMER  the consumer (worker) reading
    ARG_COUNT     how many messages to read at most

  Output: one flat array: how many messages the read delivered, then per
  admitted message its id, the number of values of its fields (two per
  field), and those values (name, value, ...).
]]
local ARG_CONSUMER = 10
local ARG_COUNT = 11

local reply = redis.call("XREADGROUP", "GROUP", group, ARGV[ARG_CONSUMER], "COUNT",
  ARGV[ARG_COUNT], "STREAMS", streamKey, ">")
if not reply then
  return { 0 }
end
local entries = reply[1][2]
local out, n = { #entries }, 1
for _, entry in ipairs(entries) do
  local msgId, fields = entry[1], entry[2] or {}
  local admitted = admittedByCount()
  if not admitted then
    local taskId = messageTaskId(fields)
    admitted = not taskId or admitOne(taskPrefix .. taskId, taskId, msgId) == ADMITTED
  end
  if admitted then
    out[n + 1], out[n + 2] = msgId, #fields
    for j = 1, #fields do
      out[n + 2 + j] = fields[j]
    end
    n = n + 2 + #fields
  end
end
admissionDone()
return out
