-- LOWER: what the provider reports. The level falls to `remaining` (never rises: other
-- clients of the same account are invisible here), and a pause empties the bucket and adds
-- the refill of the pause as debt: it is back at zero when the pause ends, then refills. As
-- in memory, a refund during the pause shortens it by the refund's worth of refill.
-- KEYS: one bucket. ARGV: clock override, num, den, capacity, remaining ('' if unknown),
--       pause in ms (0 if none).
local now = clock(ARGV[1])
local num, den, cap = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local full = cap * den
local tok, ts = load(redis.call('GET', KEYS[1]), now, num, den, full)
if ARGV[5] ~= '' then
  tok = math.min(tok, tonumber(ARGV[5]) * den)
end
local pause = tonumber(ARGV[6])
if pause > 0 then
  -- Debt grows to at most the pause's refill: a later pause extends, an earlier never shortens.
  tok = math.min(tok, math.min(0, -(pause - math.max(ts - now, 0)) * num))
end
store(KEYS[1], tok, ts, now, num, den, full)
return 1
