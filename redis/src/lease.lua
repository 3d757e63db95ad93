-- LEASE: a process's grant of the account, for a while. Every process admitting from a lease
-- (instead of asking per admission) calls this every refresh. A grant is a debit: the units
-- granted leave the account's bucket at once, and the process admits only units it holds.
-- What it holds is counted in the bucket (its `held`, see bucket.lua) until the process says
-- it spent or gave them back, or its lease ends: the bucket refills to its capacity less what
-- leases hold, so the bucket and the leases together never hold more than the capacity, and
-- the fleet never admits more than the account's burst plus its rate over any window (plus
-- the debts its processes report). Every failure errs toward less: a process that dies, stalls
-- past its lease or loses a reply takes what it held with it (lost to the fleet until the
-- bucket refills it), and a renewal that arrives after a later one (a delayed request) changes
-- nothing.
-- KEYS: the shares (a hash, see below), then the account limits' holds, their plans, and their
--       buckets.
-- ARGV: clock override, the process, the lease in ms, the fraction of the account it wants (0
--       to 1; negative: it leaves), how often (ms) the account is divided again, the renewal's
--       number (rising with every renewal of the process), then per limit: its plan's
--       increase per period, its period in ms, its bucket's num, den and capacity, and what the
--       process reports: `keep` (the units it keeps of what it held; negative, a debt it owes,
--       charged to the bucket), `back` (the units it gives back), `need` (the units its first
--       waiting request lacks: granted in every limit at once, or in none), `ask` (units it
--       would like beyond the need); then its waiting flows: pairs of a flow's key and its
--       weight, and its waiting guarantees: pairs of 'g' and a guarantee's key, and its share
--       in millionths.
-- Returns {status, the lease in ms, its part in millionths, per hold its remaining ms, per
-- limit the fleet's plan in millionths (see `plan` in bucket.lua), per limit the units
-- granted, how soon (ms) a need not granted should be covered (0 when granted), then per
-- flow asked about its weight in the process (0 when unknown at the last division), and per
-- guarantee the number of processes where it waits (1 when unknown)}.
-- `status` is 1 for a renewal, 2 for a process the store did not know (its first renewal, or
-- its lease ended), 0 when it left, -1 for a renewal older than one already seen: nothing is
-- changed, and the reply is {-1}.
--
-- The shares hash: per process "want|ends|part|seq|at|flows" (`flows` as "key=weight,...",
-- `at` when its credit last grew), per process and limit "h:<process>\n<bucket>" the units it
-- holds and its credit in thousandths of a unit ("held|credit"), "~c\n<bucket>" the sum of
-- the credits (whole numbers, so that sums never drift), "~at" the last
-- division (ms), "~f:<flow>" a flow's weight in the processes where it waited at the last
-- division, "~f:g<guarantee>" in how many processes a guarantee waited then.
--
-- Dividing (every so often: it reads and rewrites every process, so its cost grows with the
-- fleet; in between a call reads and writes its own entry only, and a process that just came
-- has no part until the next division). By tenant first: each flow (a tenant, or every
-- request of a process without tenants) gets its weighted part of the account, a flow with a
-- guarantee of its own lifted to it when that part is less (the others sharing the rest by
-- weight); its part is spread evenly over the processes where it waits, and a process weighs
-- what its flows' parts add up to, times the flows' total weight (1 when none waits). The
-- account goes to the processes by weighted max-min fairness on what each wants: none gets
-- more than it wants, and those wanting more share the rest by weight. A process is owed, of
-- what it wants, the guarantees of nodes above its flows waiting in it, each spread evenly
-- over the processes where it waits (scaled down together should they add up to more than the
-- account); one whose weighted part falls short of that is lifted to it, and the others share
-- the rest again. What nobody wants is spread by
-- weight over every process. Expired leases are dropped then: what they held leaves the
-- buckets' `held` without coming back to their levels (lost until refilled).
--
-- Granting, per limit. A process's credit grows by its part of the limit's rate while it
-- renews, and by what it gives back (its own to take again), up to its part of the capacity
-- (or its need, if larger): in turn by deficit, so that
-- whole units reach every process even when the parts are below one unit. It may take its
-- credit, and whatever of the bucket the others' credits do not claim (all of it when the
-- bucket is full: its refill would be lost waiting for them); its need whole (in
-- every limit, or nothing), then up to its ask; only whole units, only what the bucket holds.
local now = clock(ARGV[1])
local shares, me, lease, want = KEYS[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local every, seq = tonumber(ARGV[5]), tonumber(ARGV[6])
local limits = (#KEYS - 1) / 3
local first_flow = 7 + 9 * limits
local keep_ms = lease * 4
local mine = redis.call('HMGET', shares, me, '~at')
local function parse(value)
  local wanted, ends, part, seen, at, flows =
    string.match(value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
  return {want = tonumber(wanted) or 1, ends = tonumber(ends) or 0, part = tonumber(part) or 0,
    seq = tonumber(seen) or 0, at = tonumber(at) or now, flows = flows or ''}
end
local function write(who, e)
  redis.call('HSET', shares, who,
    string.format('%.6f|%.0f|%.17g|%.0f|%.0f|%s', e.want, e.ends, e.part, e.seq, e.at, e.flows))
end
local me_now = mine[1] and parse(mine[1]) or nil
if me_now and seq <= me_now.seq then
  return {-1}
end

-- Every limit's bucket, and what this process held of it.
local L = {}
for i = 1, limits do
  local a = 1 + 9 * i
  local l = {inc = tonumber(ARGV[a - 3]), period = tonumber(ARGV[a - 2]), num = tonumber(ARGV[a - 1]),
    den = tonumber(ARGV[a]), cap = tonumber(ARGV[a + 1]), keep = tonumber(ARGV[a + 2]),
    back = tonumber(ARGV[a + 3]), need = tonumber(ARGV[a + 4]), ask = tonumber(ARGV[a + 5]),
    key = KEYS[1 + 2 * limits + i]}
  if want < 0 then
    -- Leaving, it keeps nothing (but a debt).
    l.keep = math.min(l.keep, 0)
  end
  l.full = l.cap * l.den
  l.field, l.sum = 'h:' .. me .. '\n' .. l.key, '~c\n' .. l.key
  l.tok, l.ts, l.held = load(redis.call('GET', l.key), now, l.num, l.den, l.full)
  local record = redis.call('HMGET', shares, l.field, l.sum)
  local h, c = string.match(record[1] or '', '^([^|]*)|(.*)$')
  l.mine, l.credit, l.credits = tonumber(h) or 0, tonumber(c) or 0, tonumber(record[2]) or 0
  if not me_now then
    -- A process the store does not know holds nothing it can tell (what a record left behind
    -- still holds stays counted, the safe side).
    l.mine, l.credit = 0, 0
  end
  -- Its report: a debt is charged to the bucket (one capacity at most, as anywhere), what it
  -- keeps stays held, what it gives back comes back, never above what the leases leave.
  if l.keep < 0 then
    l.tok = math.max(l.tok + l.keep * l.den, math.min(l.tok, -l.full))
  end
  local kept = math.max(l.keep, 0)
  l.held = math.max(l.held - l.mine + kept, 0)
  l.mine = kept
  l.tok = math.min(l.tok + l.back * l.den, l.full - l.held * l.den)
  L[i] = l
end

local function save(l)
  store(l.key, l.tok, l.ts, now, l.num, l.den, l.full, l.held, keep_ms)
end

if want < 0 then
  for _, l in ipairs(L) do
    l.credits = math.max(l.credits - l.credit, 0)
    redis.call('HDEL', shares, l.field)
    redis.call('HSET', shares, l.sum, string.format('%.0f', l.credits))
    save(l)
  end
  redis.call('HDEL', shares, me)
  redis.call('PEXPIRE', shares, string.format('%.0f', keep_ms))
  return {0, 0, 0}
end
want = math.min(want, 1)
local flows = {}
for i = first_flow, #ARGV - 1, 2 do
  flows[#flows + 1] = ARGV[i] .. '=' .. ARGV[i + 1]
end
local entry = me_now or {part = 0, at = now}
local status = me_now and 1 or 2
entry.want, entry.ends, entry.seq, entry.flows = want, now + lease, seq, table.concat(flows, ',')
write(me, entry)

-- Divides the account anew between every live process (see above), drops the expired ones
-- (what they held leaves the buckets' `held`), and counts the credits again.
local function divide()
  local processes, spread, gone = {}, {}, {}
  local raw = redis.call('HGETALL', shares)
  for i = 1, #raw, 2 do
    local who, value = raw[i], raw[i + 1]
    if string.sub(who, 1, 3) == '~f:' then
      redis.call('HDEL', shares, who)
    elseif string.sub(who, 1, 1) ~= '~' and string.sub(who, 1, 2) ~= 'h:' then
      local e = parse(value)
      if e.ends <= now then
        redis.call('HDEL', shares, who)
        gone[who] = true
      else
        e.who, e.weights, e.guarantees = who, {}, {}
        for key, weight in string.gmatch(e.flows, '([^,=]+)=([^,]+)') do
          if string.sub(key, 1, 1) == 'g' then
            e.guarantees[#e.guarantees + 1] = {key, math.max(tonumber(weight) or 0, 0) / 1e6}
          else
            e.weights[#e.weights + 1] = {key, math.max(tonumber(weight) or 1, 1)}
          end
          spread[key] = (spread[key] or 0) + 1
        end
        processes[#processes + 1] = e
      end
    end
  end
  local by_key = {}
  for _, l in ipairs(L) do
    by_key[l.key], l.credits = l, 0
  end
  for i = 1, #raw, 2 do
    local who, key = string.match(raw[i], '^h:([^\n]*)\n(.*)$')
    if who then
      local h, c = string.match(raw[i + 1], '^([^|]*)|(.*)$')
      local l = by_key[key]
      if gone[who] or redis.call('HEXISTS', shares, who) == 0 then
        redis.call('HDEL', shares, raw[i])
        if l and who ~= me then
          l.held = math.max(l.held - (tonumber(h) or 0), 0)
        end
      elseif l and who ~= me then
        l.credits = l.credits + (tonumber(c) or 0)
      end
    end
  end
  for _, l in ipairs(L) do
    l.credits = l.credits + l.credit
  end
  -- By tenant first (see above): each flow's weighted part of the account, a flow with a
  -- guarantee of its own lifted to it, the others sharing the rest by weight.
  local fw, floor, lifted, total, floors = {}, {}, {}, 0, 0
  for _, p in ipairs(processes) do
    for _, flow in ipairs(p.weights) do
      fw[flow[1]] = math.max(fw[flow[1]] or 0, flow[2])
    end
  end
  for _, p in ipairs(processes) do
    for _, g in ipairs(p.guarantees) do
      local key = string.sub(g[1], 2)
      if fw[key] then
        floor[key] = math.max(floor[key] or 0, g[2])
      end
    end
  end
  for key, w in pairs(fw) do
    total = total + w
    floors = floors + (floor[key] or 0)
  end
  if floors > 1 then
    for key, f in pairs(floor) do
      floor[key] = f / floors
    end
  end
  local parts = {}
  while true do
    local left, weight = 1, 0
    for key, w in pairs(fw) do
      if lifted[key] then
        left = left - floor[key]
      else
        weight = weight + w
      end
    end
    local short = false
    for key, w in pairs(fw) do
      if lifted[key] then
        parts[key] = floor[key]
      else
        parts[key] = math.max(left, 0) * w / weight
      end
    end
    for key, _ in pairs(fw) do
      if not lifted[key] and parts[key] + 1e-12 < (floor[key] or 0) then
        lifted[key], short = true, true
      end
    end
    if not short then
      break
    end
  end
  local owed_total = 0
  for _, p in ipairs(processes) do
    local weight, owed = 0, 0
    for _, flow in ipairs(p.weights) do
      weight = weight + parts[flow[1]] * total / spread[flow[1]]
    end
    for _, g in ipairs(p.guarantees) do
      -- A guarantee above the flows (no flow's own) is owed by the processes where it waits.
      if not fw[string.sub(g[1], 2)] then
        owed = owed + g[2] / spread[g[1]]
      end
    end
    -- A millionth at least: its flows may get nothing (guarantees took all).
    p.weight = (#p.weights > 0) and math.max(weight, 1e-6) or 1
    p.owed = math.min(owed, p.want)
    owed_total = owed_total + p.owed
  end
  if owed_total > 1 then
    for _, p in ipairs(processes) do
      p.owed = p.owed / owed_total
    end
  end
  -- Weighted max-min fairness of `left` over the processes not lifted: whoever wants less
  -- than its weighted part of what is left gets what it wants; the others share the rest by
  -- weight. Returns what is left once every want is met.
  local function max_min(left)
    local wanting = {}
    for _, p in ipairs(processes) do
      if not p.lifted then
        p.part = 0
        if p.want > 0 then
          wanting[#wanting + 1] = p
        end
      end
    end
    while #wanting > 0 and left > 1e-9 do
      local weights = 0
      for _, p in ipairs(wanting) do
        weights = weights + p.weight
      end
      local per_weight, still, satisfied = left / weights, {}, false
      for _, p in ipairs(wanting) do
        local need = p.want - p.part
        if need <= per_weight * p.weight then
          p.part, left, satisfied = p.want, left - need, true
        else
          still[#still + 1] = p
        end
      end
      if not satisfied then
        for _, p in ipairs(still) do
          p.part = p.part + per_weight * p.weight
        end
        left, still = 0, {}
      end
      wanting = still
    end
    return math.max(left, 0)
  end
  local left
  while true do
    left = 1
    for _, p in ipairs(processes) do
      if p.lifted then
        p.part = p.owed
        left = left - p.owed
      end
    end
    left = max_min(left)
    -- Those whose part falls short of what they are owed are lifted to it.
    local short = false
    for _, p in ipairs(processes) do
      if not p.lifted and p.part + 1e-12 < p.owed then
        p.lifted, short = true, true
      end
    end
    if not short then
      break
    end
  end
  local weights = 0
  for _, p in ipairs(processes) do
    weights = weights + p.weight
  end
  for _, p in ipairs(processes) do
    if left > 1e-9 then
      p.part = p.part + left * p.weight / weights
    end
    write(p.who, p)
  end
  -- Told with every renewal: each flow's weight in the processes where it waits (its part
  -- over its spread, in units of the flows' total weight times 840), each guarantee's spread.
  for key, n in pairs(spread) do
    if fw[key] then
      n = math.max(math.floor(parts[key] * total * 840 / n + 0.5), 1)
    end
    redis.call('HSET', shares, '~f:' .. key, n)
  end
  redis.call('HSET', shares, '~at', string.format('%.0f', now))
end

local at = tonumber(mine[2])
if at == nil or now - at >= every or now < at then
  divide()
  entry = parse(redis.call('HGET', shares, me))
end

-- Granting (see above): the credits grow (in thousandths of a unit), then what each limit may
-- give this process.
local part, since = math.floor(entry.part * 1e6 + 0.5) / 1e6, math.max(now - entry.at, 0)
local whole = true
for _, l in ipairs(L) do
  local before = l.credit
  local grown = l.credit + l.back * 1000 + math.floor(part * l.num / l.den * since * 1000)
  l.credit = math.min(grown, math.max(math.floor(part * l.cap * 1000), l.need * 1000))
  l.credits = math.max(l.credits - before + l.credit, 0)
  local pool = math.max(math.floor(l.tok / l.den), 0)
  local unclaimed = math.max(pool - math.floor((l.credits - l.credit) / 1000), 0)
  if l.tok + l.den > l.full - l.held * l.den then
    -- The bucket is full: its refill is lost while the credits wait for it, so whoever asks
    -- may take it.
    unclaimed = pool
  end
  l.may = math.min(pool, math.floor(l.credit / 1000) + unclaimed)
  if l.need > l.may then
    whole = false
  end
end
entry.at = now
write(me, entry)
redis.call('PEXPIRE', shares, string.format('%.0f', keep_ms))

local reply = {status, lease, math.floor(part * 1e6 + 0.5)}
for i = 1, limits do
  local held = tonumber(redis.call('GET', KEYS[1 + i]) or '')
  reply[#reply + 1] = (held ~= nil and held > now) and math.min(held - now, 86400000) or 0
end
for i = 1, limits do
  local l = L[i]
  reply[#reply + 1] = math.floor(plan(redis.call('GET', KEYS[1 + limits + i]), now, l.inc, l.period) * 1e6 + 0.5)
end
for _, l in ipairs(L) do
  local granted = 0
  if whole then
    granted = l.need + math.max(math.min(l.ask, l.may - l.need), 0)
  end
  local before = l.credit
  l.credit = math.max(l.credit - granted * 1000, 0)
  l.credits = math.max(l.credits - before + l.credit, 0)
  l.tok = l.tok - granted * l.den
  l.held = l.held + granted
  l.mine = l.mine + granted
  redis.call('HSET', shares, l.field, string.format('%.0f|%.0f', l.mine, l.credit),
    l.sum, string.format('%.0f', l.credits))
  save(l)
  reply[#reply + 1] = granted
end
-- When the need was not granted: how soon (ms) the bucket, or this process's credit, should
-- cover it, for every limit that lacked it (the process renews then, within its refresh).
local ready = 0
if not whole then
  for _, l in ipairs(L) do
    if l.need > l.may then
      local filled = math.ceil(math.max(l.need * l.den - l.tok, 0) / l.num)
      local per_ms = part * l.num / l.den * 1000
      local owed = filled
      if per_ms > 0 then
        owed = math.ceil(math.max(l.need * 1000 - l.credit, 0) / per_ms)
      end
      ready = math.max(ready, math.min(filled, owed))
    end
  end
end
reply[#reply + 1] = ready
for i = first_flow, #ARGV - 1, 2 do
  local unknown = (string.sub(ARGV[i], 1, 1) == 'g') and 1 or 0
  reply[#reply + 1] = tonumber(redis.call('HGET', shares, '~f:' .. ARGV[i]) or '') or unknown
end
return reply
