-- SETTLE: the actual cost replaces the reserved one, once. Unused estimate is refunded, an
-- overrun is charged as debt (at most one capacity below zero).
-- KEYS: the buckets, then the reservation record.
-- ARGV: clock override, lease in ms, then per bucket: num, den, capacity, reserved, actual.
-- Returns 1 when settled, 0 when it already was, 2 when the record had expired (late: only
-- overruns are charged, nothing is refunded blind).
local now = clock(ARGV[1])
local record = KEYS[#KEYS]
local state = redis.call('HGET', record, '~')
if state == 'd' then
  return 0
end
local late = not state
for i = 1, #KEYS - 1 do
  local a = 3 + (i - 1) * 5
  local num, den, cap = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local reserved, actual = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  if not late then
    reserved = tonumber(redis.call('HGET', record, KEYS[i])) or 0
  end
  local delta = actual - reserved
  if delta > 0 or (delta < 0 and not late) then
    local full = cap * den
    local tok, ts = load(KEYS[i], now, num, full)
    tok = math.max(-full, math.min(full, tok - delta * den))
    store(KEYS[i], tok, ts, now, num, full)
  end
end
-- A tombstone for the lease, so that a duplicate is recognised.
redis.call('HSET', record, '~', 'd')
redis.call('PEXPIRE', record, tonumber(ARGV[2]))
if late then
  return 2
end
return 1
