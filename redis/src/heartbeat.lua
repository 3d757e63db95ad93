-- HEARTBEAT: renews a process's lease on the slots it holds (see controls.lua); once a
-- minute, forgets the processes whose lease ended more than a minute ago. Returns how many
-- processes' leases are current, this one's included.
-- KEYS: the leases (a hash: process, "<end>/<start>" in server ms).
-- ARGV: clock override, the process, the lease in ms.
local now = clock(ARGV[1])
renew(KEYS[1], ARGV[2], now, tonumber(ARGV[3]))
local pruned = tonumber(redis.call('HGET', KEYS[1], '~pruned') or '') or 0
local prune = now - pruned > 60000
local live = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= '~pruned' then
    local ends = tonumber(string.match(all[i + 1], '^(%d+)/'))
    if ends ~= nil and ends > now then
      live = live + 1
    elseif prune and (ends == nil or ends < now - 60000) then
      redis.call('HDEL', KEYS[1], all[i])
    end
  end
end
if prune then
  redis.call('HSET', KEYS[1], '~pruned', now)
end
return live
