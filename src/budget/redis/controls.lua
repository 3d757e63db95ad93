-- Shared by the reserve and settle scripts: the controls of tenant nodes kept for every
-- process, daily caps and calls in flight.
--
-- A node's days are a hash, `<node>:days`, a field per cap: `c:<dimension>` holds
-- "<day>:<used>" for a calendar day in UTC (days since the epoch, by the server's clock);
-- `r:<dimension>` holds "<quarter>=<used> ..." for the last 24 hours, one entry per quarter
-- hour (since the epoch) that used something, oldest first, those a day old dropped. The
-- hash expires two days after its last write.
--
-- A node's slots are a hash, `<node>:slots`, a field per call in flight: its reservation id,
-- `<process>-<n>`. A slot counts while its process is alive: the hash `alive` holds each
-- process's lease end (server ms), renewed by its heartbeat and by each slot it takes, so
-- the slots of a process that died come back when its lease ends.

local DAY, QUARTER, QUARTERS = 86400000, 900000, 96

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
  if string.sub(field, 1, 1) == 'c' then
    local day, used = string.match(value, '^(%d+):(%d+)$')
    if tonumber(day) == math.floor(now / DAY) then
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
  if string.sub(field, 1, 1) == 'c' then
    local used = math.max(day_used(key, field, now) + delta, 0)
    redis.call('HSET', key, field, string.format('%.0f:%.0f', math.floor(now / DAY), used))
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
  redis.call('PEXPIRE', key, 2 * DAY)
end

-- How many slots of `key` live processes hold, at most `max` counted exactly: below it, the
-- count of fields is enough; at it, the slots of processes whose lease ended are dropped.
local function slots_held(key, alive, now, max)
  local held = redis.call('HLEN', key)
  if held < max then
    return held
  end
  local live, count = {}, 0
  for _, id in ipairs(redis.call('HKEYS', key)) do
    local process = string.match(id, '^([^-]*)')
    if live[process] == nil then
      local ends = tonumber(redis.call('HGET', alive, process) or '')
      live[process] = ends ~= nil and ends > now
    end
    if live[process] then
      count = count + 1
    else
      redis.call('HDEL', key, id)
    end
  end
  return count
end
