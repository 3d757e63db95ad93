-- Shared by the reserve and settle scripts: the controls of tenant nodes kept for every
-- process, daily caps and calls in flight.
--
-- A node's caps are a hash, `<node>:days`, a field per cap: `c:<dimension>` holds
-- "<day>:<used>" for a calendar day in UTC (days since the epoch, by the server's clock);
-- `m:<dimension>` holds "<month>:<used>" for a calendar month in UTC (months since the
-- epoch); `r:<dimension>` holds "<quarter>=<used> ..." for the last 24 hours, one entry per
-- quarter hour (since the epoch) that used something, oldest first, those a day old dropped.
-- The hash expires 62 days after its last write (a month and its successor).
--
-- A node's slots are a hash, `<node>:slots`, a field per call in flight: its reservation id,
-- `<process>-<n>`, holding the start of its process's lease when it was taken. The hash
-- `alive` holds each process's lease, "<end>/<start>" (server ms): renewed by its heartbeat
-- and by each slot it takes, it starts again when it had ended. A slot counts while the lease
-- it was taken under lasts: the slots of a process that died come back when its lease ends,
-- and those of a process cut off past its lease stay given back when it returns.

local DAY, QUARTER, QUARTERS = 86400000, 900000, 96

-- The calendar period holding `now` of a cap of kind `kind` ('c' or 'm'): days since the
-- epoch, or months (H. Hinnant's civil_from_days, on whole numbers).
local function period(kind, now)
  local days = math.floor(now / DAY)
  if kind == 'c' then
    return days
  end
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local month = mp < 10 and mp + 3 or mp - 9
  local year = yoe + era * 400 + (month <= 2 and 1 or 0)
  return (year - 1970) * 12 + month - 1
end

-- The quarter hours of a rolling cap's `value` still in the window at `now`: a list of
-- {quarter, used}, oldest first.
local function quarters(value, now)
  local first, list = math.floor(now / QUARTER) - QUARTERS + 1, {}
  for q, used in string.gmatch(value or '', '(%d+)=(%d+)') do
    q, used = tonumber(q), tonumber(used)
    if q >= first and used > 0 then
      list[#list + 1] = {q, used}
    end
  end
  return list
end

-- What the cap `field` of the days `key` has used at `now`.
local function day_used(key, field, now)
  local value = redis.call('HGET', key, field)
  if not value then
    return 0
  end
  local kind = string.sub(field, 1, 1)
  if kind ~= 'r' then
    local at, used = string.match(value, '^(%d+):(%d+)$')
    if tonumber(at) == period(kind, now) then
      return tonumber(used)
    end
    return 0
  end
  local sum = 0
  for _, entry in ipairs(quarters(value, now)) do
    sum = sum + entry[2]
  end
  return sum
end

-- Counts `delta` units at `now` in the cap `field` of the days `key`; a negative `delta` (a
-- refund) is taken from the current day, or from the latest quarter hours, never below zero.
local function day_add(key, field, delta, now)
  if delta == 0 then
    return
  end
  local kind = string.sub(field, 1, 1)
  if kind ~= 'r' then
    local used = math.max(day_used(key, field, now) + delta, 0)
    redis.call('HSET', key, field, string.format('%.0f:%.0f', period(kind, now), used))
  else
    local list, q = quarters(redis.call('HGET', key, field), now), math.floor(now / QUARTER)
    if delta > 0 then
      if #list > 0 and list[#list][1] == q then
        list[#list][2] = list[#list][2] + delta
      else
        list[#list + 1] = {q, delta}
      end
    else
      local left = -delta
      for i = #list, 1, -1 do
        local taken = math.min(left, list[i][2])
        list[i][2], left = list[i][2] - taken, left - taken
      end
    end
    local parts = {}
    for _, entry in ipairs(list) do
      if entry[2] > 0 then
        parts[#parts + 1] = string.format('%.0f=%.0f', entry[1], entry[2])
      end
    end
    redis.call('HSET', key, field, table.concat(parts, ' '))
  end
  redis.call('PEXPIRE', key, 62 * DAY)
end

-- Renews `process`'s lease in `alive` until `now + lease`; returns the start of that lease
-- (`now` when it had ended, or was never taken).
local function renew(alive, process, now, lease)
  local value = redis.call('HGET', alive, process) or ''
  local ends, start = string.match(value, '^(%d+)/(%d+)$')
  ends, start = tonumber(ends), tonumber(start)
  if ends == nil or start == nil or ends <= now then
    start = now
  end
  redis.call('HSET', alive, process, string.format('%.0f/%.0f', now + lease, start))
  -- The hash outlives the latest lease in it, no more: once every process has stopped
  -- renewing, no lease is current and the key goes.
  if redis.call('PTTL', alive) < lease then
    redis.call('PEXPIRE', alive, lease)
  end
  return start
end

-- How many slots of `key` are held under leases that last, at most `max` counted exactly:
-- below it, the count of fields is enough; at it, the slots whose lease ended are dropped.
local function slots_held(key, alive, now, max)
  local held = redis.call('HLEN', key)
  if held < max then
    return held
  end
  local leases, count = {}, 0
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local id, taken = all[i], tonumber(all[i + 1])
    local process = string.match(id, '^([^-]*)')
    if leases[process] == nil then
      local ends, start = string.match(redis.call('HGET', alive, process) or '', '^(%d+)/(%d+)$')
      leases[process] = {tonumber(ends) or 0, tonumber(start) or -1}
    end
    local lease = leases[process]
    if lease[1] > now and lease[2] == taken then
      count = count + 1
    else
      redis.call('HDEL', key, id)
    end
  end
  return count
end
