-- RESERVE: every touched limit pays `cost` (leaving `floor` untouched), or none does; none
-- does while a limit is held (a provider's pause, see lower.lua), nor when it would delay the
-- process whose turn it is (see below), nor while a node of the request's tenant path is
-- paused, has spent its daily cap, or has every slot of its in-flight cap taken (see
-- controls.lua).
-- KEYS: the buckets, then their holds (in the same order), then the reservation record, the
--       line of processes waiting for the account (a sorted set), its details (a hash), the
--       paused tenant nodes (a set), the processes' leases on their slots (a hash), the
--       processes' clocks (a sorted set), then the days and slots of the path's nodes that
--       have controls.
-- ARGV: clock override ('' in production), lease in ms, the asking process ('' to take no
--       turns), its request's class rank (0 first), how many of the buckets (the first ones)
--       are the account's, the grace in ms a process has to come back when told, the number
--       of buckets, the number of nodes of the request's tenant path, the process's part of
--       the account in millionths (its last lease call's, see lease.lua), then per bucket: num,
--       den, capacity, cost, floor (units), then the nodes of the path, from the top, then
--       per control: its kind ('s' slots, 'c' a calendar day, 'm' a calendar month, 'r' a
--       rolling day), its key's index in KEYS, its field (the cap's; for slots, the reservation
--       id), its cap, and the amount it counts (the cost in the cap's dimension; for slots,
--       the lease on them in ms).
-- Returns {1, level...} when admitted, {0, wait_ms, bucket, held, floor_only, first} when not
-- yet (`held` is 1 when the bucket's hold is what the wait is for, `floor_only` 1 when no
-- bucket is held and every bucket holds the cost, so that only the floors keep it out,
-- `first` 1 when the process is first in line), {-1, bucket} when the cost can never fit,
-- {-2} when the id was already settled, {-3, depth} when the node at `depth` of the path is
-- paused, {-4, control, used} when a daily cap is spent, {-5, control} when every slot of a
-- cap on calls in flight is held.
--
-- Turns. A process refused for want of the account's capacity joins a line, ranked by its
-- request's class, then by its request's stamp, with what its request needs of each account
-- bucket. The stamps are a virtual clock per process (start-time fair queuing between
-- processes): a request starts at the later of the account's virtual time and its process's
-- last stamp, and its stamp is that start plus the milliseconds the account takes to refill
-- its cost, over its process's part of the account (the fleet's division by tenant: the
-- weights of the tenants waiting in it). So processes waiting together are served in
-- proportion to their parts, whatever their requests' sizes. Each admission moves its
-- process's clock to the stamp. The account's virtual time is the lowest start served last
-- among the processes that asked within their grace (never moving back): a process that backfilled,
-- or asked while another was between two questions, runs its own clock ahead without
-- pushing the others' starts up to it, so it is paid back in turns it waits; a clock runs
-- ahead by a bounded lead (see below), so that no process waits longer than that for what
-- it took early. Until
-- the first in line is dropped, another process is admitted only if the first would still
-- find its need at the instant it was told to come back (backfilling); else it is refused,
-- told to come back then. So the refill goes to the process whose turn it is, not to
-- whoever asks first (also when the first comes back late, its process busy), and no
-- capacity the first does not need stays idle. Admitted, a process leaves the line; one that
-- does not come back within its grace is dropped from it (what it needed, at most one
-- request's cost, was kept aside until then).
-- How far (virtual ms) a process's clock may run ahead of the account's virtual time, beyond
-- its request.
local LEAD = 200
-- How long (ms) an admitted process keeps its place in line, expected back.
local RETURN = 10
local now = clock(ARGV[1])
local n, depths = tonumber(ARGV[7]), tonumber(ARGV[8])
local line, details, paused = KEYS[2 * n + 2], KEYS[2 * n + 3], KEYS[2 * n + 4]
local alive, clocks = KEYS[2 * n + 5], KEYS[2 * n + 6]
local me, rank, accounts, grace = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
-- Where the path's nodes and the controls start in ARGV.
local nodes = 10 + 5 * n
-- A thousandth at least: the stamps stay far below the class ranks' 2^44.
local part = math.max(tonumber(ARGV[9]) or 1000000, 1000) / 1e6
local controls = nodes + depths
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
if depths > 0 and redis.call('EXISTS', paused) == 1 then
  for depth = 1, depths do
    if redis.call('SISMEMBER', paused, ARGV[nodes + depth - 1]) == 1 then
      return {-3, depth}
    end
  end
end

-- A spent daily cap refuses; a cap on calls in flight whose every slot is held waits.
local counted = {}
for c = 1, (#ARGV - controls + 1) / 5 do
  local a = controls + (c - 1) * 5
  local kind, key, field = ARGV[a], KEYS[tonumber(ARGV[a + 1])], ARGV[a + 2]
  local cap, amount = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  if kind == 's' then
    if slots_held(key, alive, now, cap) >= cap then
      return {-5, c}
    end
    counted[#counted + 1] = {kind, key, field, amount}
  elseif amount > 0 then
    local used = day_used(key, field, now)
    if used + amount > cap then
      return {-4, c, used}
    end
    counted[#counted + 1] = {kind, key, field, amount}
  end
end

-- Every bucket's rate, cost and level now.
local num, den, cap, cost, floor, toks, tss, helds = {}, {}, {}, {}, {}, {}, {}, {}
for i = 1, n do
  local a = 10 + (i - 1) * 5
  num[i], den[i], cap[i] = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  cost[i], floor[i] = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  if cost[i] + floor[i] > cap[i] then
    return {-1, i}
  end
  toks[i], tss[i], helds[i] = load(values[i], now, num[i], den[i], cap[i] * den[i])
end

-- The request's start and stamp on the virtual clock (see Turns above).
local start, stamp = 0, 0
if takes_turns then
  local ms = 0
  for i = 1, math.min(accounts, n) do
    ms = math.max(ms, cost[i] * den[i] / num[i])
  end
  local v = tonumber(redis.call('HGET', details, '~v') or '') or 0
  local vc = tonumber(redis.call('HGET', details, me .. ':vc') or '') or 0
  -- A clock runs at most LEAD ms (and this request) ahead of the virtual time: while the
  -- account is not saturated every process is admitted at once, and a small part's clock
  -- would race ahead (to wait that far once it saturates); one that took turns while others
  -- were between two questions gives them back, but waits no longer than that either.
  start = math.min(math.max(v, vc), v + LEAD + ms / part)
  stamp = start + ms / part
end

-- Joins the line (or moves within it, by its request's class), to come back in `wait` ms
-- needing its cost and floor of each account bucket.
local function line_up(wait, next_stamp)
  if next_stamp then
    redis.call('HSET', details, me .. ':since', next_stamp, me .. ':kept', 1)
  elseif redis.call('HDEL', details, me .. ':kept') == 1 then
    -- Back after an admission: its request's own stamp replaces the estimate.
    redis.call('HSET', details, me .. ':since', stamp)
  else
    redis.call('HSETNX', details, me .. ':since', stamp)
  end
  local since = tonumber(redis.call('HGET', details, me .. ':since'))
  redis.call('ZADD', line, rank * 2 ^ 44 + since, me)
  local needs = {}
  for i = 1, accounts do
    needs[i] = KEYS[i] .. '=' .. (cost[i] + floor[i])
  end
  local back = now + wait
  local expected = next_stamp and (now + RETURN) or (back + math.floor(wait / 25) + grace)
  redis.call('HSET', details, me .. ':ready', back, me .. ':until', expected,
    me .. ':needs', table.concat(needs, '|'))
  -- Kept five seconds after the last process in line is expected back (idle that long, the
  -- clocks start again from zero).
  local keep = string.format('%.0f',
    math.max(redis.call('PTTL', details), wait + math.floor(wait / 25) + grace + 5000))
  redis.call('HSET', details, me .. ':seen', now)
  redis.call('PEXPIRE', line, keep)
  redis.call('PEXPIRE', details, keep)
  redis.call('PEXPIRE', clocks, keep)
end

-- Whether taking this cost now leaves, in every account bucket `who` needs, its need by the
-- instant `ready` it comes back (refill counted, capped at the capacity).
local function leaves_enough(who, ready)
  local needs = redis.call('HGET', details, who .. ':needs') or ''
  for i = 1, accounts do
    local need = tonumber(string.match(needs, KEYS[i]:gsub('%p', '%%%0') .. '=(%d+)'))
    if need ~= nil then
      local later = toks[i] - cost[i] * den[i] + math.max(ready - now, 0) * num[i]
      if math.min(later, (cap[i] - helds[i]) * den[i]) < need * den[i] then
        return false
      end
    end
  end
  return true
end

-- Whose turn it is: the first process in line still expected back, unless this one would
-- rank before it. Another's turn refuses this request unless the first keeps its need.
if takes_turns then
  local since = stamp
  if redis.call('HEXISTS', details, me .. ':kept') == 0 then
    since = tonumber(redis.call('HGET', details, me .. ':since') or '') or stamp
  end
  local mine = rank * 2 ^ 44 + since
  while true do
    local first = redis.call('ZRANGE', line, 0, 0, 'WITHSCORES')
    if #first == 0 or first[1] == me or tonumber(first[2]) > mine then
      break
    end
    local who = first[1]
    local expected = tonumber(redis.call('HGET', details, who .. ':until') or '') or 0
    local ready = tonumber(redis.call('HGET', details, who .. ':ready') or '') or now
    if expected >= now then
      -- Expected back (also late: its process may be busy), it keeps its place and its need.
      if leaves_enough(who, ready) then
        break
      end
      local wait = math.max(ready - now, 1)
      line_up(wait)
      return {0, wait, 1, 0, 0, 0}
    end
    -- It did not come back: it left the line (its requests ended, or it died).
    redis.call('ZREM', line, who)
    redis.call('HDEL', details, who .. ':since', who .. ':ready', who .. ':until', who .. ':needs',
      who .. ':kept')
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
  store(KEYS[i], tok, tss[i], now, num[i], den[i], cap[i] * den[i], helds[i])
  record[#record + 1] = '|' .. KEYS[i] .. '=' .. ARGV[10 + (i - 1) * 5 + 3]
  reply[i + 1] = math.floor(tok / den[i])
end
redis.call('SET', KEYS[2 * n + 1], table.concat(record), 'PX', ARGV[2])
-- The path's controls count the call: its day's use, its slot under its process's lease.
for _, c in ipairs(counted) do
  local kind, key, field, amount = c[1], c[2], c[3], c[4]
  if kind == 's' then
    -- The field is the reservation id, `<process>-<n>`; the value, its process's lease.
    local start = renew(alive, string.match(field, '^([^-]*)'), now, amount)
    redis.call('HSET', key, field, string.format('%.0f', start))
    redis.call('PEXPIRE', key, ARGV[2])
  else
    day_add(key, field, amount, now)
  end
end
if takes_turns then
  -- Its clock moves to the stamp; the account's virtual time to the lowest start served
  -- last among the processes that asked within their grace (the others are dropped). The
  -- clocks are forgotten with the line (see line_up): they start again from zero.
  redis.call('ZADD', clocks, start, me)
  -- It keeps its place for RETURN ms, expected back with a request like this one: a process
  -- whose clients ask one after another is not between two questions when its turn comes.
  line_up(0, stamp + (stamp - start))
  redis.call('HSET', details, me .. ':vc', stamp, me .. ':seen', now)
  local v = tonumber(redis.call('HGET', details, '~v') or '') or 0
  while true do
    local lowest = redis.call('ZRANGE', clocks, 0, 0, 'WITHSCORES')
    local who = lowest[1]
    local seen = tonumber(redis.call('HGET', details, who .. ':seen') or '') or 0
    if seen + grace >= now then
      v = math.max(v, tonumber(lowest[2]))
      break
    end
    redis.call('ZREM', clocks, who)
    redis.call('HDEL', details, who .. ':seen', who .. ':vc')
  end
  redis.call('HSET', details, '~v', v)
end
return reply
