-- Shared by every script of the Redis store: the clock, and one bucket's refill and write.
--
-- A bucket is a string "<tok>:<ts>". `tok` counts ticks: one unit (a request, a token) is
-- `den` ticks and each millisecond adds `num` ticks, so refill is exact integer arithmetic for
-- any rate. `ts` is the millisecond up to which the bucket was refilled; it lies in the future
-- while the bucket is paused. An absent key is a full bucket, so a key may expire as soon as
-- its bucket would be full again. Every number stays below 2^53: the client picks `den` so.

-- The server's clock in milliseconds, never the caller's (`override` exists for tests only).
local function clock(override)
  if override ~= nil and override ~= '' then
    return tonumber(override)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The bucket stored as `value` (false when absent), refilled up to `now`. Time going
-- backwards (a failover to another clock) adds nothing: `ts` only ever moves forward.
local function load(value, now, num, full)
  if not value then
    return full, now
  end
  local tok, ts = string.match(value, '^(-?%d+):(%d+)$')
  tok, ts = tonumber(tok), tonumber(ts)
  if tok == nil or ts == nil then
    return full, now
  end
  if now > ts then
    local deficit = full - tok
    if deficit > 0 then
      local dt = now - ts
      if dt > deficit / num then
        tok = full
      else
        tok = math.min(full, tok + dt * num)
      end
    end
    ts = now
  end
  return tok, ts
end

-- Writes the bucket with a TTL of its time to full (an absent key is a full bucket).
local function store(key, tok, ts, now, num, full)
  if tok >= full and ts <= now then
    redis.call('DEL', key)
    return
  end
  local ttl = math.ceil((full - tok) / num) + math.max(ts - now, 0) + 1000
  redis.call('SET', key, string.format('%.0f:%.0f', tok, ts), 'PX', string.format('%.0f', ttl))
end
