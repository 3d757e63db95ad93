-- HEARTBEAT: renews a process's lease on the slots it holds (see controls.lua); once a
-- minute, forgets the processes whose lease ended more than a minute ago.
-- KEYS: the leases (a hash: process, "<end>/<start>" in server ms).
-- ARGV: clock override, the process, the lease in ms.
local now = clock(ARGV[1])
renew(KEYS[1], ARGV[2], now, tonumber(ARGV[3]))
local pruned = tonumber(redis.call('HGET', KEYS[1], '~pruned') or '') or 0
if now - pruned > 60000 then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local ends = tonumber(string.match(all[i + 1], '^(%d+)/'))
    if all[i] ~= '~pruned' and (ends == nil or ends < now - 60000) then
      redis.call('HDEL', KEYS[1], all[i])
    end
  end
  redis.call('HSET', KEYS[1], '~pruned', now)
end
return 1
