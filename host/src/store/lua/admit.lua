--[[
  Admit a batch of messages of a queue with limits delivered already (by
  a wait, a reclaim, or a read back) before they start: the admission of
  include/admission.lua, which says what is admitted and what is held. A
  busy queue's new messages are read and admitted in one step instead
  (`read_admit.lua`).

  Input:
    KEYS[1..3] as include/admission.lua
    KEYS[4..]  one task hash per message, dtq:task:{q}:<id>

    ARGV by name (the ARG_ locals; store/limits.rs, ADMIT_ARGV): those of
    include/admission.lua, then from ARG_DELIVERIES, per task hash k (from
    0), in the same order: its stream message id, its task id

  Output: one code per message, in order: 1 admitted, 2 held by the rate
  limit, 3 held by its group.
]]
local ARG_DELIVERIES = 10

local out = {}
for i = 4, #KEYS do
  local d = ARG_DELIVERIES + 2 * (i - 4)
  out[#out + 1] = admitOne(KEYS[i], ARGV[d + 1], ARGV[d])
end
admissionDone()
return out
