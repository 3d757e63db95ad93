-- LOWER: what the provider reports. The level falls to `remaining` less what the leases hold
-- (never rises: other clients of the same account are invisible here). What a lease holds and
-- has not spent is still in the provider's `remaining`: the bucket keeps only the rest, or a
-- holder giving its units back would count them twice. Units spent but not yet reported are
-- subtracted twice until the holder's next report: capacity left unused for a moment, never
-- spent twice. A pause (a 429) is a hold: the instant
-- (server ms) before which no reservation touching this bucket is admitted, kept in a key of
-- its own that expires at that instant. It leaves the level alone, so the bucket keeps
-- refilling and admits what it holds when the hold ends. A later pause extends a hold; an
-- earlier end never shortens it; nothing else (a refund, a report) does either.
-- A pause that starts a hold (none was on) also lowers the fleet's adaptive plan for the
-- limit, once for every process: its share times `decrease`, `min` at least (see `plan` in
-- bucket.lua); the processes leasing shares plan with it at their next renewal.
-- KEYS: the bucket, its hold, its plan. ARGV: clock override, num, den, capacity, remaining
--       ('' if unknown), pause in ms (0 if none), then for an adaptive limit: decrease, min,
--       increase per period, period in ms ('' when the limit's share is fixed).
local now = clock(ARGV[1])
if ARGV[5] ~= '' then
  local num, den, cap = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
  local full = cap * den
  local tok, ts, held = load(redis.call('GET', KEYS[1]), now, num, den, full)
  tok = math.min(tok, math.max(tonumber(ARGV[5]) - held, 0) * den)
  store(KEYS[1], tok, ts, now, num, den, full, held)
end
local pause = tonumber(ARGV[6])
if pause > 0 then
  local ends = now + pause
  local held = tonumber(redis.call('GET', KEYS[2]) or '')
  if ARGV[7] ~= nil and ARGV[7] ~= '' and (held == nil or held <= now) then
    local decrease, min = tonumber(ARGV[7]), tonumber(ARGV[8])
    local increase, period = tonumber(ARGV[9]), tonumber(ARGV[10])
    local share = math.max(min, plan(redis.call('GET', KEYS[3]), now, increase, period) * decrease)
    -- Gone once the plan is whole again.
    local whole = math.ceil((1 - share) / increase * period) + 1
    redis.call('SET', KEYS[3], string.format('%.6f|%.0f', share, now), 'PX', whole)
  end
  if held == nil or ends > held then
    redis.call('SET', KEYS[2], string.format('%.0f', ends), 'PX', string.format('%.0f', pause))
  end
end
return 1
