-- DAYS: what tenant nodes' daily caps have used in their current day, counted for every
-- process (see controls.lua). Reads only.
-- KEYS: each cap's node days. ARGV: clock override ('' in production), then each cap's field.
-- Returns the units each cap has used.
local now = clock(ARGV[1])
local used = {}
for i = 1, #KEYS do
  used[i] = day_used(KEYS[i], ARGV[i + 1], now)
end
return used
