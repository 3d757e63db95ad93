-- RESERVE: every touched limit pays `cost` (leaving `floor` untouched), or none does; none
-- does while a limit is held (a provider's pause, see lower.lua).
-- KEYS: the buckets, then their holds (in the same order), then the reservation record.
-- ARGV: clock override ('' in production), lease in ms, then per bucket: num, den,
--       capacity, cost, floor (units).
-- Returns {1, level...} when admitted, {0, wait_ms, bucket, held, floor_only} when not yet
-- (nothing written; `held` is 1 when the bucket's hold is what the wait is for, `floor_only` 1
-- when no bucket is held and every bucket holds the cost, so that only the floors keep it out),
-- {-1, bucket} when the cost can never fit, {-2} when the id was already settled.
local now = clock(ARGV[1])
local n = (#KEYS - 1) / 2
local values = redis.call('MGET', unpack(KEYS))
local existing = values[2 * n + 1]
if existing == 'd' then
  -- The id was released or settled already: it admits nothing again.
  return {-2}
elseif existing then
  -- A retried call whose first attempt was admitted: the decision stands.
  return {1}
end
local toks, tss = {}, {}
local wait, limiting, by_hold, short = 0, 0, 0, 0
for i = 1, n do
  local a = 3 + (i - 1) * 5
  local num, den, cap = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local cost, floor = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  if cost + floor > cap then
    return {-1, i}
  end
  local tok, ts = load(values[i], now, num, den, cap * den)
  toks[i], tss[i] = tok, ts
  local need = (cost + floor) * den
  if tok < cost * den then
    short = 1
  end
  local w = 0
  if tok < need then
    w = math.max(ts - now, 0) + math.ceil((need - tok) / num)
  end
  local held = tonumber(values[n + i] or '')
  local hold = 0
  if held ~= nil and held > now then
    -- A day at most, as written (a clock stepping back, or a key not written by lower.lua,
    -- never holds longer).
    hold = math.min(held - now, 86400000)
    short = 1
  end
  if math.max(w, hold) > wait then
    wait, limiting = math.max(w, hold), i
    by_hold = (hold >= w) and 1 or 0
  end
end
if limiting > 0 then
  return {0, wait, limiting, by_hold, 1 - short}
end
-- The record: "r" and, per bucket, "|<key>=<cost>", so that settling knows what was taken.
local reply, record = {1}, {'r'}
for i = 1, n do
  local a = 3 + (i - 1) * 5
  local num, den, cap = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local cost = tonumber(ARGV[a + 3])
  local tok = toks[i] - cost * den
  store(KEYS[i], tok, tss[i], now, num, den, cap * den)
  record[#record + 1] = '|' .. KEYS[i] .. '=' .. ARGV[a + 3]
  reply[i + 1] = math.floor(tok / den)
end
redis.call('SET', KEYS[2 * n + 1], table.concat(record), 'PX', ARGV[2])
return reply
