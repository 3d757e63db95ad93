-- LEASE: a process's share of the account, for a while. Every process admitting from a share
-- (instead of asking per admission) calls this every refresh: it tells what it wants, and is
-- granted a fraction of every account limit (of its rate and of its burst) until the lease
-- ends. The shares granted and not yet expired never add up to more than the whole account,
-- so the processes together never admit more than it (see "Granting" below).
-- KEYS: the shares (a hash: process -> "held|want|weight|ends|flows"), then the account
--       buckets' holds.
-- ARGV: clock override, the process, the lease in ms, the fraction of the account it wants
--       (0 to 1; negative: it leaves, giving its share back), then its waiting flows: pairs
--       of a flow's key and its weight.
-- Returns {share in millionths, the lease in ms, per hold its remaining ms, then per flow
-- asked about the number of processes where it waits}.
--
-- Dividing. Each flow (a tenant, or every request of a process without tenants) weighs its
-- weight, spread evenly over the processes where it waits; a process weighs the sum of its
-- flows' parts (1 when none waits). The account goes to the processes by weighted max-min
-- fairness on what each wants: none gets more than it wants, and those wanting more share
-- the rest by weight. What nobody wants is spread by weight over every process, so that a
-- process's next burst starts at once.
--
-- Granting. A process is granted its part, less what the others hold beyond their own parts
-- (they give it back at their next call, within one refresh), so the shares held never add
-- up to more than one.
local now = clock(ARGV[1])
local shares, me, lease, want = KEYS[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
if want < 0 then
  redis.call('HDEL', shares, me)
  return {0, 0}
end
want = math.min(want, 1)

-- Every live process: what it holds, wants and weighs, and its waiting flows.
local processes, mine = {}, nil
local function flows_of(text)
  local flows = {}
  for key, weight in string.gmatch(text, '([^,=]+)=([^,]+)') do
    flows[#flows + 1] = {key, tonumber(weight)}
  end
  return flows
end
local my_flows = {}
for i = 5, #ARGV - 1, 2 do
  my_flows[#my_flows + 1] = {ARGV[i], tonumber(ARGV[i + 1])}
end
local raw = redis.call('HGETALL', shares)
for i = 1, #raw, 2 do
  local who, value = raw[i], raw[i + 1]
  if who ~= me then
    local held, wanted, ends, flows = string.match(value, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
    if tonumber(ends) == nil or tonumber(ends) <= now then
      redis.call('HDEL', shares, who)
    else
      processes[#processes + 1] = {
        who = who, held = tonumber(held) or 1, want = tonumber(wanted) or 1,
        flows = flows_of(flows)}
    end
  end
end
mine = {who = me, held = 0, want = want, flows = my_flows}
processes[#processes + 1] = mine

-- How many processes each flow waits in, and what each process weighs.
local spread = {}
for _, p in ipairs(processes) do
  for _, flow in ipairs(p.flows) do
    spread[flow[1]] = (spread[flow[1]] or 0) + 1
  end
end
for _, p in ipairs(processes) do
  local weight = 0
  for _, flow in ipairs(p.flows) do
    weight = weight + math.max(flow[2], 1) / spread[flow[1]]
  end
  p.weight = (#p.flows > 0) and weight or 1
  p.part = 0
end

-- Weighted max-min fairness: whoever wants less than its weighted part of what is left gets
-- what it wants; the others share the rest by weight.
local left, wanting = 1, {}
for _, p in ipairs(processes) do
  if p.want > 0 then
    wanting[#wanting + 1] = p
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
if left > 1e-9 then
  local weights = 0
  for _, p in ipairs(processes) do
    weights = weights + p.weight
  end
  for _, p in ipairs(processes) do
    p.part = p.part + left * p.weight / weights
  end
end

-- Granted: its part, less what the others hold beyond theirs.
local others = 0
for _, p in ipairs(processes) do
  if p ~= mine then
    others = others + p.held
  end
end
local granted = math.max(0, math.min(mine.part, 1 - others))
-- Rounded down to millionths, so that the shares held never add up to more than one.
granted = math.floor(granted * 1e6) / 1e6
local my_weight_flows = {}
for _, flow in ipairs(my_flows) do
  my_weight_flows[#my_weight_flows + 1] = flow[1] .. '=' .. flow[2]
end
redis.call('HSET', shares, me, string.format('%.6f|%.6f|%.0f|%s', granted, want, now + lease,
  table.concat(my_weight_flows, ',')))
redis.call('PEXPIRE', shares, string.format('%.0f', lease * 4))

local reply = {math.floor(granted * 1e6 + 0.5), lease}
for i = 2, #KEYS do
  local held = tonumber(redis.call('GET', KEYS[i]) or '')
  reply[#reply + 1] = (held ~= nil and held > now) and math.min(held - now, 86400000) or 0
end
for _, flow in ipairs(my_flows) do
  reply[#reply + 1] = spread[flow[1]]
end
return reply
