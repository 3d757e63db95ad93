-- LOWER: what the provider reports. The level falls to `remaining` (never rises: other
-- clients of the same account are invisible here). A pause (a 429) is a hold: the instant
-- (server ms) before which no reservation touching this bucket is admitted, kept in a key of
-- its own that expires at that instant. It leaves the level alone, so the bucket keeps
-- refilling and admits what it holds when the hold ends. A later pause extends a hold; an
-- earlier end never shortens it; nothing else (a refund, a report) does either.
-- KEYS: the bucket, its hold. ARGV: clock override, num, den, capacity, remaining ('' if
--       unknown), pause in ms (0 if none).
local now = clock(ARGV[1])
if ARGV[5] ~= '' then
  local num, den, cap = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
  local full = cap * den
  local tok, ts = load(redis.call('GET', KEYS[1]), now, num, den, full)
  tok = math.min(tok, tonumber(ARGV[5]) * den)
  store(KEYS[1], tok, ts, now, num, den, full)
end
local pause = tonumber(ARGV[6])
if pause > 0 then
  local ends = now + pause
  local held = tonumber(redis.call('GET', KEYS[2]) or '')
  if held == nil or ends > held then
    redis.call('SET', KEYS[2], string.format('%.0f', ends), 'PX', string.format('%.0f', pause))
  end
end
return 1
