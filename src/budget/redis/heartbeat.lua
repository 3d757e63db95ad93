-- HEARTBEAT: renews a process's lease on the slots it holds (see controls.lua); once a
-- minute, forgets the processes whose lease ended more than a minute ago.
-- KEYS: the leases (a hash: process, server instant its lease ends).
-- ARGV: clock override, the process, the lease in ms.
local now = clock(ARGV[1])
local lease = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[2], now + lease)
local pruned = tonumber(redis.call('HGET', KEYS[1], '~pruned') or '') or 0
if now - pruned > 60000 then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local ends = tonumber(all[i + 1])
    if all[i] ~= '~pruned' and (ends == nil or ends < now - 60000) then
      redis.call('HDEL', KEYS[1], all[i])
    end
  end
  redis.call('HSET', KEYS[1], '~pruned', now)
end
redis.call('PEXPIRE', KEYS[1], lease + 60000)
return 1
