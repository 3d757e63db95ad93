-- SETTLE: for each reservation, once, the actual cost replaces the reserved one. Unused
-- estimate is refunded, an overrun is charged as debt (down to one capacity below zero at
-- most; a deeper debt, which an earlier version of these scripts wrote for a pause, is kept
-- and refills).
-- Many reservations are settled in one call; each bucket is read and written once.
-- The controls of its tenant path's nodes follow (see controls.lua): its slots are given back
-- (also when its record expired, or was settled: a slot is the reservation id, so giving it
-- back twice is nothing), its daily counts take the difference as the buckets do.
-- KEYS: the buckets, then the reservation records, then the controls' days and slots.
-- ARGV: clock override, how long a tombstone lives (ms), the number of buckets, then per
--       bucket: num, den, capacity; then per reservation: its record's index in KEYS, the
--       number k of its buckets, the number c of its controls, then k times: bucket index,
--       reserved, actual; then c times: kind ('s', 'c', 'm' or 'r'), key index, field (for slots,
--       the reservation id), actual less reserved.
-- Returns per reservation: 1 settled, 0 already settled, 2 late (its record had expired:
-- only overruns are charged, nothing is refunded blind).
local now = clock(ARGV[1])
local buckets = tonumber(ARGV[3])
local values = redis.call('MGET', unpack(KEYS))
local rates, levels, settled = {}, {}, {}
local a = 4
for b = 1, buckets do
  rates[b] = {tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])}
  a = a + 3
end
local answers = {}
while a <= #ARGV do
  local r, k, c = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  -- A record named twice in one call is settled once: look it up by name.
  local record = settled[KEYS[r]] or values[r]
  if record == 'd' then
    answers[#answers + 1] = 0
  else
    local late = not record
    for j = 1, k do
      local b, reserved, actual = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
      a = a + 3
      if not late then
        -- What was taken from this bucket, as the record says (nothing if it is not named).
        reserved = 0
        local at = string.find(record, '|' .. KEYS[b] .. '=', 1, true)
        if at then
          reserved = tonumber(string.match(record, '^(%d+)', at + #KEYS[b] + 2)) or 0
        end
      end
      local delta = actual - reserved
      if delta > 0 or (delta < 0 and not late) then
        local num, den, cap = rates[b][1], rates[b][2], rates[b][3]
        local full = cap * den
        local level = levels[b]
        if not level then
          local tok, ts, held = load(values[b], now, num, den, full)
          level = {tok, ts, held}
          levels[b] = level
        end
        local tok = level[1] - delta * den
        if delta > 0 then
          -- An overrun's debt stops at one capacity; a deeper one (an earlier version's pause)
          -- is kept.
          tok = math.max(tok, math.min(level[1], -full))
        end
        level[1] = math.min(full - level[3] * den, tok)
      end
    end
    -- A tombstone, so that a duplicate is recognised.
    redis.call('SET', KEYS[r], 'd', 'PX', ARGV[2])
    settled[KEYS[r]] = 'd'
    answers[#answers + 1] = late and 2 or 1
  end
  if record == 'd' then
    a = a + 3 * k
  end
  for _ = 1, c do
    local kind, key, field, delta = ARGV[a], KEYS[tonumber(ARGV[a + 1])], ARGV[a + 2],
      tonumber(ARGV[a + 3])
    a = a + 4
    if kind == 's' then
      redis.call('HDEL', key, field)
    elseif record ~= 'd' and (delta > 0 or (delta < 0 and record)) then
      day_add(key, field, delta, now)
    end
  end
end
for b, level in pairs(levels) do
  local num, den, cap = rates[b][1], rates[b][2], rates[b][3]
  store(KEYS[b], level[1], level[2], now, num, den, cap * den, level[3])
end
return answers
