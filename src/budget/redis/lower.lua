-- LOWER: what the provider reports. The level falls to `remaining` (never rises: other
-- clients of the same account are invisible here), and a pause empties the bucket until it
-- ends, after which it refills from zero.
-- KEYS: one bucket. ARGV: clock override, num, den, capacity, remaining ('' if unknown),
--       pause in ms (0 if none).
local now = clock(ARGV[1])
local num, den, cap = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local full = cap * den
local tok, ts = load(redis.call('GET', KEYS[1]), now, num, full)
if ARGV[5] ~= '' then
  tok = math.min(tok, tonumber(ARGV[5]) * den)
end
local pause = tonumber(ARGV[6])
if pause > 0 then
  tok = math.min(tok, 0)
  ts = math.max(ts, now + pause)
end
store(KEYS[1], tok, ts, now, num, full)
return 1
