-- RESERVE: every touched limit pays `cost` (leaving `floor` untouched), or none does; none
-- does while a limit is held (a provider's pause, see lower.lua), nor when it would delay the
-- process whose turn it is (see below).
-- KEYS: the buckets, then their holds (in the same order), then the reservation record, the
--       line of processes waiting for the account (a sorted set), its details (a hash), and
--       the paused tenant nodes (a set).
-- ARGV: clock override ('' in production), lease in ms, the asking process ('' to take no
--       turns), its request's class rank (0 first), how many of the buckets (the first ones)
--       are the account's, the grace in ms a process has to come back when told, then per
--       bucket: num, den, capacity, cost, floor (units), then the nodes of the request's
--       tenant path, from the top.
-- Returns {1, level...} when admitted, {0, wait_ms, bucket, held, floor_only, first} when not
-- yet (`held` is 1 when the bucket's hold is what the wait is for, `floor_only` 1 when no
-- bucket is held and every bucket holds the cost, so that only the floors keep it out,
-- `first` 1 when the process is first in line), {-1, bucket} when the cost can never fit,
-- {-2} when the id was already settled, {-3, depth} when the node at `depth` of the path is
-- paused.
--
-- Turns. A process refused for want of the account's capacity joins a line, ranked by its
-- request's class, then by when it was first refused, with what its request needs of each
-- account bucket. Until the instant it was told to come back (and a few ms of slack), another
-- process is admitted only if the first would still find its need then (backfilling); else it
-- is refused, told to come back then. So the refill goes to the process whose turn it is, not
-- to whoever asks first, and no capacity the first does not need stays idle; a first that
-- comes back late keeps its place but not what it waited for. Admitted, a process leaves the
-- line; one that does not come back within its grace is dropped from it.
-- How late (ms) the first in line may come back and still find its need kept for it.
local SLACK = 5
local now = clock(ARGV[1])
local n = (#KEYS - 4) / 2
local line, details, paused = KEYS[2 * n + 2], KEYS[2 * n + 3], KEYS[2 * n + 4]
local me, rank, accounts, grace = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local takes_turns = me ~= '' and accounts > 0
local values = redis.call('MGET', unpack(KEYS, 1, 2 * n + 1))
local existing = values[2 * n + 1]
if existing == 'd' then
  -- The id was released or settled already: it admits nothing again.
  return {-2}
elseif existing then
  -- A retried call whose first attempt was admitted: the decision stands.
  return {1}
end

-- A paused node of the path refuses, whatever the buckets hold.
local nodes = 7 + 5 * n
if #ARGV >= nodes and redis.call('EXISTS', paused) == 1 then
  for depth = 1, #ARGV - nodes + 1 do
    if redis.call('SISMEMBER', paused, ARGV[nodes + depth - 1]) == 1 then
      return {-3, depth}
    end
  end
end

-- Every bucket's rate, cost and level now.
local num, den, cap, cost, floor, toks, tss = {}, {}, {}, {}, {}, {}, {}
for i = 1, n do
  local a = 7 + (i - 1) * 5
  num[i], den[i], cap[i] = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  cost[i], floor[i] = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  if cost[i] + floor[i] > cap[i] then
    return {-1, i}
  end
  toks[i], tss[i] = load(values[i], now, num[i], den[i], cap[i] * den[i])
end

-- Joins the line (or moves within it, by its request's class), to come back in `wait` ms
-- needing its cost and floor of each account bucket.
local function line_up(wait)
  redis.call('HSETNX', details, me .. ':since', now)
  local since = tonumber(redis.call('HGET', details, me .. ':since'))
  redis.call('ZADD', line, rank * 2 ^ 44 + since, me)
  local needs = {}
  for i = 1, accounts do
    needs[i] = KEYS[i] .. '=' .. (cost[i] + floor[i])
  end
  local back = now + wait
  redis.call('HSET', details, me .. ':ready', back, me .. ':until',
    back + math.floor(wait / 25) + grace, me .. ':needs', table.concat(needs, '|'))
  local keep = string.format('%.0f', wait + grace + 60000)
  redis.call('PEXPIRE', line, keep)
  redis.call('PEXPIRE', details, keep)
end

-- Whether taking this cost now leaves, in every account bucket `who` needs, its need by the
-- instant `ready` it comes back (refill counted, capped at the capacity).
local function leaves_enough(who, ready)
  local needs = redis.call('HGET', details, who .. ':needs') or ''
  for i = 1, accounts do
    local need = tonumber(string.match(needs, KEYS[i]:gsub('%p', '%%%0') .. '=(%d+)'))
    if need ~= nil then
      local later = toks[i] - cost[i] * den[i] + math.max(ready - now, 0) * num[i]
      if math.min(later, cap[i] * den[i]) < need * den[i] then
        return false
      end
    end
  end
  return true
end

-- Whose turn it is: the first process in line still expected back, unless this one would
-- rank before it. Another's turn refuses this request unless the first keeps its need.
if takes_turns then
  local since = tonumber(redis.call('HGET', details, me .. ':since') or '') or now
  local mine = rank * 2 ^ 44 + since
  while true do
    local first = redis.call('ZRANGE', line, 0, 0, 'WITHSCORES')
    if #first == 0 or first[1] == me or tonumber(first[2]) > mine then
      break
    end
    local who = first[1]
    local expected = tonumber(redis.call('HGET', details, who .. ':until') or '') or 0
    local ready = tonumber(redis.call('HGET', details, who .. ':ready') or '') or now
    if now <= ready + SLACK then
      if leaves_enough(who, ready) then
        break
      end
      local wait = math.max(ready - now, 1)
      line_up(wait)
      return {0, wait, 1, 0, 0, 0}
    elseif expected >= now then
      -- Late (its head may wait for something else, a slot of its own): it keeps its place
      -- in line, but what it waited for goes to whoever asks meanwhile.
      break
    end
    -- It did not come back: it left the line (its requests ended, or it died).
    redis.call('ZREM', line, who)
    redis.call('HDEL', details, who .. ':since', who .. ':ready', who .. ':until', who .. ':needs')
  end
end

local wait, limiting, by_hold, short = 0, 0, 0, 0
for i = 1, n do
  local tok = toks[i]
  local need = (cost[i] + floor[i]) * den[i]
  if tok < cost[i] * den[i] then
    short = 1
  end
  local w = 0
  if tok < need then
    w = math.max(tss[i] - now, 0) + math.ceil((need - tok) / num[i])
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
  -- Short of the account's capacity (not of a tenant node's, nor only of a floor, nor held
  -- by a provider's pause, which holds every process alike): in line.
  local first = 0
  if takes_turns and limiting <= accounts and short == 1 and by_hold == 0 then
    line_up(wait)
    local head = redis.call('ZRANGE', line, 0, 0)
    first = (head[1] == me) and 1 or 0
  end
  return {0, wait, limiting, by_hold, 1 - short, first}
end
-- The record: "r" and, per bucket, "|<key>=<cost>", so that settling knows what was taken.
local reply, record = {1}, {'r'}
for i = 1, n do
  local tok = toks[i] - cost[i] * den[i]
  store(KEYS[i], tok, tss[i], now, num[i], den[i], cap[i] * den[i])
  record[#record + 1] = '|' .. KEYS[i] .. '=' .. ARGV[7 + (i - 1) * 5 + 3]
  reply[i + 1] = math.floor(tok / den[i])
end
redis.call('SET', KEYS[2 * n + 1], table.concat(record), 'PX', ARGV[2])
if takes_turns then
  redis.call('ZREM', line, me)
  redis.call('HDEL', details, me .. ':since', me .. ':ready', me .. ':until', me .. ':needs')
end
return reply
