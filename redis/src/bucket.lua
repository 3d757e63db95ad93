-- Shared by every script of the Redis store: the clock, and one bucket's refill and write.
--
-- A bucket is a string "<units>:<ticks>:<den>:<ts>[:<held>]". Its level is `units` whole units
-- (requests or tokens) plus `ticks` of a unit, one unit being `den` ticks: each millisecond adds
-- `num` ticks, so refill is exact integer arithmetic for any rate. `held` is what the leases
-- granted out of the bucket still hold (see lease.lua): the bucket refills to its capacity less
-- that, so that the bucket and the leases together never hold more than the capacity. `den` is stored because
-- processes may configure a limit differently (a rolling deploy, a limit lowered by a
-- provider's headers): one reading another's bucket rescales the fraction, rounding down,
-- while whole units mean the same to all. `ts` is the millisecond up to which the bucket was
-- refilled. An absent key is a full bucket, so a key may expire as soon as its bucket would
-- be full again. Every number stays below 2^53: the client picks `den` so.

-- The server's clock in milliseconds, never the caller's (`override` exists for tests only).
local function clock(override)
  if override ~= nil and override ~= '' then
    return tonumber(override)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The bucket stored as `value` (false when absent) in ticks of `den`, refilled up to `now`, and
-- what leases hold of it (units). Time going backwards (a failover to another clock) adds
-- nothing: `ts` only moves forward.
local function load(value, now, num, den, full)
  if not value then
    return full, now, 0
  end
  local units, ticks, stored, ts, held =
    string.match(value, '^(-?%d+):(%d+):(%d+):(%d+):?(%d*)$')
  units, ticks, stored, ts = tonumber(units), tonumber(ticks), tonumber(stored), tonumber(ts)
  held = tonumber(held) or 0
  if units == nil or ticks == nil or stored == nil or stored == 0 or ts == nil then
    return full, now, 0
  end
  if stored ~= den then
    ticks = math.floor(ticks * den / stored)
  end
  local top = full - held * den
  local tok = math.min(top, units * den + ticks)
  if now > ts then
    local deficit = top - tok
    if deficit > 0 then
      local dt = now - ts
      if dt > deficit / num then
        tok = top
      else
        tok = math.min(top, tok + dt * num)
      end
    end
    ts = now
  end
  return tok, ts, held
end

-- Writes the bucket with a TTL of its time to full (an absent key is a full bucket): the
-- time its level takes to refill to the whole capacity, the units leases hold counted as
-- refilling (they were taken when granted: once their holders are gone, the bucket refills
-- them; expiring sooner would hand them out again). While leases hold some of it (`held`,
-- units), the key is also kept at least `keep` ms (the leases' own time), and never less than
-- it already had.
local function store(key, tok, ts, now, num, den, full, held, keep)
  held = held or 0
  if tok >= full and ts <= now and held <= 0 then
    redis.call('DEL', key)
    return
  end
  local units = math.floor(tok / den)
  local ticks = tok - units * den
  if ticks < 0 then
    units, ticks = units - 1, ticks + den
  elseif ticks >= den then
    units, ticks = units + 1, ticks - den
  end
  local ttl = math.ceil(math.max(full - tok, 0) / num) + math.max(ts - now, 0) + 1000
  if held > 0 then
    ttl = math.max(ttl, keep or 0, redis.call('PTTL', key))
  end
  local value = string.format('%.0f:%.0f:%.0f:%.0f', units, ticks, den, ts)
  if held > 0 then
    value = value .. string.format(':%.0f', held)
  end
  redis.call('SET', key, value, 'PX', string.format('%.0f', ttl))
end

-- The fleet's adaptive plan for a limit: the share of its amount the processes plan for,
-- stored as "<share>|<ms>" (the share set at that instant, after a 429). It climbs back by
-- `increase` per period of `period_ms` from then, to the whole amount at most; an absent key
-- is the whole amount.
local function plan(value, now, increase, period_ms)
  if not value then
    return 1
  end
  local share, at = string.match(value, '^([^|]+)|(.+)$')
  share, at = tonumber(share), tonumber(at)
  if share == nil or at == nil then
    return 1
  end
  return math.min(1, share + increase * math.max(now - at, 0) / period_ms)
end
