-- LEASE: a process's share of the account, for a while. Every process admitting from a share
-- (instead of asking per admission) calls this every refresh: it tells what it wants, and is
-- granted a fraction of every account limit (of its rate and of its burst) until the lease
-- ends. The shares granted and not yet expired never add up to more than the whole account,
-- so the processes together never admit more than it (see "Granting" below).
-- Each account bucket follows the fleet's spending, as each process reports it at its
-- renewal (so a refresh late): a process that joins starts with its share of what the
-- bucket holds, not with nothing.
-- KEYS: the shares (a hash, see below), then the account buckets' holds, their plans, and
--       the buckets.
-- ARGV: clock override, the process, the lease in ms, the fraction of the account it wants
--       (0 to 1; negative: it leaves, giving its share back), how often (ms) the account is
--       divided again, then per limit its plan's increase per period, its period in ms, its
--       bucket's num, den and capacity, and the units the process spent since its last
--       renewal; then its waiting flows: pairs of a flow's key and its weight, and its
--       waiting guarantees: pairs of 'g' and a guarantee's key, and its share in millionths.
-- Returns {share in millionths, the lease in ms, per hold its remaining ms, per limit the
-- fleet's plan in millionths (see `plan` in bucket.lua), per bucket its level (units), then
-- per flow and guarantee asked about the number of processes where it waits}.
--
-- The shares hash: per process "held|want|ends|part|flows" (`held` in millionths, `flows` as
-- "key=weight,..."), "~at" the last division (ms), "~held" the sum of the shares held (in
-- millionths: whole numbers, so that no rounding drifts), "~f:<flow>" in how many processes
-- a flow waited at the last division.
--
-- Dividing (every so often: it reads and rewrites every process, so its cost grows with the
-- fleet; in between a call reads and writes its own entry only, and a process that just came
-- holds nothing until the next division). Each
-- flow (a tenant, or every request of a process without tenants) weighs its weight, spread
-- evenly over the processes where it waits; a process weighs the sum of its flows' parts (1
-- when none waits). The account goes to the processes by weighted max-min fairness on what
-- each wants: none gets more than it wants, and those wanting more share the rest by weight.
-- A process is owed, of what it wants, the guarantees waiting in it, each spread evenly over
-- the processes where it waits (scaled down together should they add up to more than the
-- account); one whose weighted part falls short of that is lifted to it, and the others
-- share the rest again. What nobody wants is spread by weight over every process, so that
-- a process's next burst starts at once. Expired leases are dropped then.
--
-- Granting. A process is granted its part, less what the others hold beyond their own parts
-- (they give it back at their next call, within one refresh), rounded down to millionths, so
-- the shares held never add up to more than one.
local now = clock(ARGV[1])
local shares, me, lease, want = KEYS[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local every = tonumber(ARGV[5])
local limits = (#KEYS - 1) / 3
local first_flow = 6 + 6 * limits
local mine = redis.call('HMGET', shares, me, '~at', '~held')
local function parse(value)
  local held, wanted, ends, part, flows =
    string.match(value, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
  return {held = tonumber(held) or 1000000, want = tonumber(wanted) or 1, ends = tonumber(ends) or 0,
    part = tonumber(part) or 0, flows = flows or ''}
end
local function write(who, e)
  redis.call('HSET', shares, who,
    string.format('%.0f|%.6f|%.0f|%.9f|%s', e.held, e.want, e.ends, e.part, e.flows))
end
local held_total = tonumber(mine[3]) or 0
local me_now = mine[1] and parse(mine[1]) or nil

if want < 0 then
  if me_now then
    redis.call('HDEL', shares, me)
    redis.call('HSET', shares, '~held', string.format('%.0f', math.max(held_total - me_now.held, 0)))
  end
  return {0, 0}
end
want = math.min(want, 1)
local flows = {}
for i = first_flow, #ARGV - 1, 2 do
  flows[#flows + 1] = ARGV[i] .. '=' .. ARGV[i + 1]
end
local entry = me_now or {held = 0, part = 0}
entry.want, entry.ends, entry.flows = want, now + lease, table.concat(flows, ',')
write(me, entry)

-- Divides the account anew between every live process (see above).
local function divide()
  local processes, spread, total = {}, {}, 0
  local raw = redis.call('HGETALL', shares)
  for i = 1, #raw, 2 do
    local who, value = raw[i], raw[i + 1]
    if string.sub(who, 1, 3) == '~f:' then
      redis.call('HDEL', shares, who)
    elseif string.sub(who, 1, 1) ~= '~' then
      local e = parse(value)
      if e.ends <= now then
        redis.call('HDEL', shares, who)
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
        total = total + e.held
      end
    end
  end
  local owed_total = 0
  for _, p in ipairs(processes) do
    local weight, owed = 0, 0
    for _, flow in ipairs(p.weights) do
      weight = weight + flow[2] / spread[flow[1]]
    end
    for _, g in ipairs(p.guarantees) do
      owed = owed + g[2] / spread[g[1]]
    end
    p.weight = (#p.weights > 0) and weight or 1
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
  for key, n in pairs(spread) do
    redis.call('HSET', shares, '~f:' .. key, n)
  end
  redis.call('HSET', shares, '~at', string.format('%.0f', now))
  return total
end

local at = tonumber(mine[2])
if at == nil or now - at >= every or now < at then
  held_total = divide()
  entry = parse(redis.call('HGET', shares, me))
end

-- Granted (in millionths): its part, less what the others hold beyond theirs. A part is
-- rounded down, after a thousandth of a millionth for a fraction's last binary digit.
local others = math.max(held_total - entry.held, 0)
local granted = math.max(0, math.min(math.floor(entry.part * 1e6 + 0.001), 1000000 - others))
entry.held = granted
write(me, entry)
redis.call('HSET', shares, '~held', string.format('%.0f', others + granted))
redis.call('PEXPIRE', shares, string.format('%.0f', lease * 4))

local reply = {granted, lease}
for i = 2, 1 + limits do
  local held = tonumber(redis.call('GET', KEYS[i]) or '')
  reply[#reply + 1] = (held ~= nil and held > now) and math.min(held - now, 86400000) or 0
end
for i = 1, limits do
  local increase, period = tonumber(ARGV[6 * i]), tonumber(ARGV[6 * i + 1])
  local share = plan(redis.call('GET', KEYS[1 + limits + i]), now, increase, period)
  reply[#reply + 1] = math.floor(share * 1e6 + 0.5)
end
for i = 1, limits do
  local a = 6 * i + 2
  local num, den, cap = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local key, full = KEYS[1 + 2 * limits + i], cap * den
  local tok, ts = load(redis.call('GET', key), now, num, den, full)
  -- What the process spent: a debt of one capacity at most, as anywhere else.
  tok = math.max(tok - tonumber(ARGV[a + 3]) * den, math.min(tok, -full))
  store(key, tok, ts, now, num, den, full)
  reply[#reply + 1] = math.max(math.floor(tok / den), 0)
end
for i = first_flow, #ARGV - 1, 2 do
  reply[#reply + 1] = tonumber(redis.call('HGET', shares, '~f:' .. ARGV[i]) or '') or 1
end
return reply
