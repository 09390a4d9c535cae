-- refund.lua undoes what decide.lua charged for one request when another hash tag of the same
-- request refused it (Redis Cluster only: keys of different tags live in different slots, so one
-- script cannot check them all). Keys keep their TTL.
--
-- KEYS[i]   the key of rule i; then the ARGV[3] idempotency records the decision wrote
-- ARGV[1]   the time decide.lua charged at, in microseconds
-- ARGV[2]   the request id decide.lua was given
-- ARGV[3]   how many idempotency records follow the rules' keys ("" for none)
-- ARGV[4+4(i-1) ...] per rule: kind, rate, period_us, cost

local floor = math.floor
local now = tonumber(ARGV[1])
local id = ARGV[2]
local function fmt(x) return string.format('%.17g', x) end
-- The fixed window's and the sliding window counter's packings, as in decide.lua.
local FW_WINDOWS, FW_SHIFT = 4194304, 2147483648
local SW_WINDOWS, SW_SHIFT = 4, 33554432

local m = tonumber(ARGV[3]) or 0
local n = #KEYS - m
for j = n + 1, #KEYS do
  -- The record said the request was admitted; it was not, in the end. A first record goes; a
  -- repeat's count goes back.
  local seen = tonumber(redis.call('GET', KEYS[j]) or nil)
  if seen == 0 then
    redis.call('DEL', KEYS[j])
  elseif seen and seen > 0 then
    redis.call('SET', KEYS[j], fmt(seen - 1), 'KEEPTTL')
  end
end

for i = 1, n do
  local b = 4 + (i - 1) * 4
  local kind, rate = tonumber(ARGV[b]), tonumber(ARGV[b + 1])
  local period, cost = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  local key = KEYS[i]
  local v
  if kind ~= 4 and kind ~= 6 then v = redis.call('GET', key) end -- kinds 4 and 6 are sorted sets
  if kind == 1 or kind == 2 then
    if v then
      redis.call('SET', key, struct.pack('<d', struct.unpack('<d', v) - cost * (period / rate)), 'KEEPTTL')
    end
  elseif kind == 3 then
    if v then
      v = tonumber(v)
      local w = floor(v / FW_SHIFT)
      if w == floor(now / period) % FW_WINDOWS then
        local n = v - w * FW_SHIFT
        redis.call('SET', key, fmt(w * FW_SHIFT + math.max(0, n - cost)), 'KEEPTTL')
      end
    end
  elseif kind == 5 then
    if v then
      local idx = floor(now / period)
      local n = tonumber(v)
      if n then
        local w = floor(n / (SW_SHIFT * SW_SHIFT))
        local rest = n - w * SW_SHIFT * SW_SHIFT
        local c = floor(rest / SW_SHIFT)
        local p = rest - c * SW_SHIFT
        if w == idx % SW_WINDOWS then
          c = math.max(0, c - cost)
        elseif w == (idx + 1) % SW_WINDOWS then
          p = math.max(0, p - cost)
        end
        redis.call('SET', key, fmt((w * SW_SHIFT + c) * SW_SHIFT + p), 'KEEPTTL')
      else
        local w, c, p = string.match(v, '^(%S+) (%S+) (%S+)$')
        if tonumber(w) == idx then
          c = fmt(math.max(0, tonumber(c) - cost))
        elseif tonumber(w) == idx + 1 then
          p = fmt(math.max(0, tonumber(p) - cost))
        end
        redis.call('SET', key, w .. ' ' .. c .. ' ' .. p, 'KEEPTTL')
      end
    end
  elseif kind == 4 or kind == 6 then
    -- The request's one member (a sliding log's entry, a concurrency limit's lease), and its
    -- units from the total (decide.lua's layout).
    if redis.call('ZREM', key, id .. ':' .. cost) == 1 then
      redis.call('ZINCRBY', key, fmt(-cost), '#')
    end
  end
end
return 1
