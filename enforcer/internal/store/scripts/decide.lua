-- decide.lua decides one request against every rule whose key shares this call's hash tag. It
-- checks all rules first and charges them only if every enforced rule allows: a refused request
-- consumes nothing. The arithmetic mirrors enforcer/algorithm operation for operation, so both
-- stores reach identical decisions. The same script, in another mode, ends a request once its
-- response has ended (finish) or renews its leases (renew); see the end of the file.
--
-- The file defines functions only, the last one run(KEYS, ARGV), which decides a call: the store
-- loads it as a Redis function library, whose functions are made once, and calls run by FCALL,
-- or sends it by EVALSHA with `return run(KEYS, ARGV)` appended
-- (enforcer/internal/store/scripts.go). Per-call state lives in the file's locals that run sets;
-- nothing else may outlive a call.
--
-- KEYS[i]   the key of rule i, i = 1..n; then KEYS[n+j], j = 1..m: idempotency record j; then
--           KEYS[n+m+k]: the leases of the k-th leased token bucket (see below)
-- ARGV[1]   "" in production: the time comes from Redis TIME. Tests may pass microseconds.
-- ARGV[2]   the request's id, unique per request: a sliding log's member for it, and a
--           concurrency limit's lease, is id:cost
-- ARGV[3]   "" or, per record j, "<window_ms>:<free repeats>", separated by spaces
-- ARGV[4]   the mode: d (decide), f (finish) or r (renew)
-- ARGV[5]   the enforcer's name, unique per process: the field of the units it leases
-- ARGV[6+16(i-1) ...] per rule: kind, limit, rate, period_us, maxwait_us, cost, enforce (1 or
--           0), record (0 for none, else the j of the record of the rule's policy and client),
--           deferred (1 for a rule charged by the response: checked at cost, never charged here),
--           leases (0 for none, else the k of the key of the bucket's leases), take (-1 for no
--           lease; else the most units to lease beyond cost), expiry_us (the lease's), back
--           (a fixed window's units of a lease its enforcer never used, given back first),
--           back_us (the time they were leased at: a window takes back only its own), hold
--           (units of its lease the enforcer keeps holding beside those it takes), spent_us (when
--           it last spent units of its lease; 0 for now)
--
-- Returns {committed, now_us, then per rule: allowed, remaining, reset_us, retry_us, wait_us,
-- leased}; leased is the units charged beyond cost for the enforcer to decide from (take);
-- committed is 1 when the request was charged, 2 when it passed as a free repeat of an admitted
-- request on every rule (nothing charged), 0 when it was refused. A rule's allowed is 2 when it
-- passed as a free repeat: its record admitted the request before, so it is not charged. retry_us is -1 for a rule the request can
-- never pass: its cost exceeds the rule's limit (or is negative). Such a cost is refused before
-- any other arithmetic, never an error, so it never reaches the failure mode.
--
-- Idempotency records, one per policy and client that enabled idempotency (the record's name
-- hashes the idempotency key with the client's identity, under the rules' hash tag), with the
-- window as TTL: an integer, the repeats seen so far of an admitted request (0 after the
-- first), or -1 for a refused one, whose record lives until the first refusal's Retry-After
-- instead. A free repeat passes only the rules of its record; every other rule of the request is
-- decided and charged as usual.
--
-- State, one key per rule, always with a TTL of the time after which it is idle again. The TTL
-- only collects garbage: window indexes are stored in the values, so a key that outlives its
-- window is never misread.
--   token bucket, leaky bucket: 8 bytes, the double T (theoretical arrival / next free
--                               departure) as struct.pack('<d') writes it: exact, and 16 bytes
--                               of Redis memory less than its 17 digits of text
--   fixed window:               integer (W mod 2^22) * 2^31 + N (window index, count): an integer
--                               value costs Redis 16 bytes less than text; N < 2^31 and the key
--                               lives at most one window, so the index modulo 2^22 is unambiguous
--   sliding window counter:     integer ((W mod 4) * 2^25 + N) * 2^25 + P (window index, current
--                               count, previous count) while both counts are below 2^25; the key
--                               lives at most two windows, so the index modulo 4 is unambiguous.
--                               Larger counts: string "W N P". Both are read whatever the limit.
--   sliding log:                sorted set of one member id:units per admitted request, scored by
--                               its admission time, and the member '#' whose score is the units
--                               held less 2^53 (LOG_BASE): below any admission time, exact, and
--                               read in O(1). A request of any cost adds one member.
--   concurrency:                sorted set of one member id:units per request in flight, its
--                               lease, scored by the lease's expiry, and the member '#' as for
--                               the sliding log: the slots held. Expired leases (score <= now)
--                               are dropped, and their slots given back, by every call that
--                               reads the key; the key's TTL is the last lease's expiry.
--   leases of a token bucket:   a hash of one field per enforcer holding units of it,
--                               "<units>:<expiry_us>". Leased units are charged to the bucket
--                               when taken; while out, they also lower what the bucket may
--                               refill to (limit - units out), so that the units an enforcer
--                               holds and the bucket's own never make more than one bucket. An
--                               expired lease's bound is applied up to its expiry, in expiry
--                               order, then dropped; the hash outlives the last expiry by the
--                               bucket's span, after which the bucket is full whatever it held.

-- math's functions, set by run: a library loading (FUNCTION LOAD) may not read Lua's libraries.
local floor, ceil, max, min
local W = 16 -- arguments per rule
local B = 6 -- the first rule's first argument

-- A call's arguments and what it reads once, set by run: the helpers below are defined once per
-- library load (FCALL), or per call (EVAL, on a Redis without functions).
local keys, argv, now, id, n, nrecs, leases, recs, logged

-- Numbers given to redis.call are formatted with 14 digits; timestamps need 17.
local function fmt(x) return string.format('%.17g', x) end
-- A fixed window's value packs its window index modulo FW_WINDOWS above a count below FW_SHIFT;
-- both fit the 53 bits a Lua number holds exactly. Limits are at most 10^9 < 2^31.
local FW_WINDOWS, FW_SHIFT = 4194304, 2147483648
-- The sliding log's total member '#' is scored units - LOG_BASE, exact below 2^53.
local LOG_BASE = 9007199254740992
-- retry_us of a cost a rule can never admit.
local NEVER = -1
local function ttl(reset_us) return max(1, ceil(reset_us / 1000)) end
local function arg(i, f) return argv[B + (i - 1) * W + f] end

-- decide decides rule i for a request of cost units, 0 <= cost <= limit, by its algorithm (see
-- below). It returns allowed, remaining, reset_us, retry_us, wait_us and the value to write if
-- the request is charged. It changes nothing, except that a sliding log drops entries that left
-- its window.
local decide

-- The algorithms and what only they use, in a block of their own: its locals are closed when it
-- ends, so that the functions made after it (every call, by EVAL) find theirs in fewer steps.
do
  -- Comparison slack, as in enforcer/algorithm: 1µs for buckets, 1e-9 units for window counters.
  local SLACK_US, SLACK_UNITS = 1, 1e-9
  local LAST_SHARE = 0.5
  -- The sliding window counter's packing: counts below SW_SHIFT, the window index modulo SW_WINDOWS.
  local SW_WINDOWS, SW_SHIFT = 4, 33554432

  local function us(x) if x <= 0 then return 0 end return ceil(x) end
  -- later is a bucket's time t plus d >= 0 rounded up, as in enforcer/algorithm: when the sum
  -- rounds down, one float step (2^(e-53) for t = m * 2^e, 0.5 <= m < 1) is added back.
  local function later(t, d)
    local s = t + d
    if s - t < d then
      local _, e = math.frexp(s)
      s = s + 2 ^ (e - 53)
    end
    return s
  end
  -- Admission times are at least LOG_MIN, above every total's score for limits below 2^52.
  local LOG_MIN = '-4503599627370496'
  local function units(member) return tonumber(string.match(member, ':(%d+)$')) end

  -- trimmed is the units a log key holds (a sliding log's entries, a concurrency rule's leases)
  -- once the entries scored at or before horizon have left it: its '#' member keeps the total, so
  -- the key is read by the entries that leave, not all it holds.
  local function trimmed(key, horizon)
    local total = redis.call('ZSCORE', key, '#')
    local n = 0
    if total then n = tonumber(total) + LOG_BASE end
    local h = fmt(horizon)
    local expired = redis.call('ZRANGEBYSCORE', key, LOG_MIN, h)
    if #expired > 0 then
      for _, m in ipairs(expired) do n = n - units(m) end
      redis.call('ZREMRANGEBYSCORE', key, LOG_MIN, h)
      redis.call('ZADD', key, fmt(n - LOG_BASE), '#')
    end
    return n
  end

  -- swcRead returns a sliding window counter's window (its index modulo SW_WINDOWS if packed),
  -- current count and previous count.
  local function swcRead(v)
    local n = tonumber(v)
    if n then
      local w = floor(n / (SW_SHIFT * SW_SHIFT))
      local rest = n - w * SW_SHIFT * SW_SHIFT
      local c = floor(rest / SW_SHIFT)
      return w, c, rest - c * SW_SHIFT
    end
    local w, c, p = string.match(v, '^(%S+) (%S+) (%S+)$')
    return tonumber(w), tonumber(c), tonumber(p)
  end

  local function swcWrite(idx, cur, prev)
    if cur < SW_SHIFT and prev < SW_SHIFT then
      return fmt(((idx % SW_WINDOWS) * SW_SHIFT + cur) * SW_SHIFT + prev)
    end
    return fmt(idx) .. ' ' .. fmt(cur) .. ' ' .. fmt(prev)
  end


  -- leases[i], for a token bucket whose units enforcers lease: its hash's key, the units out, the
  -- bucket's time t with the expired leases' bounds applied, the fields of those, and the latest
  -- expiry of the others. Read once per call.
  local function leased(i, t, interval)
    local k = tonumber(arg(i, 9))
    if k == 0 then return t, 0 end
    local l = leases[i]
    if not l then
      l = {key = keys[n + nrecs + k], out = 0, gone = {}, last = 0}
      local all = redis.call('HGETALL', l.key)
      local ended = {}
      -- A request that takes replaces what its enforcer held: units it has spent, or spends now,
      -- but for those it keeps holding. They were held until it last spent some: the bound of
      -- all of them holds until then, like an expiry's.
      local mine = tonumber(arg(i, 10)) >= 0 and argv[5]
      for j = 1, #all, 2 do
        local u, e = string.match(all[j + 1], '^(%d+):(%d+)$')
        u, e = tonumber(u), tonumber(e)
        if e > now and all[j] == mine then
          local spent = tonumber(arg(i, 15))
          if spent <= 0 or spent > now then spent = now end
          ended[#ended + 1] = {u = u - min(u, tonumber(arg(i, 14))), e = spent}
        end
        l.out = l.out + u
        if e <= now then
          ended[#ended + 1] = {u = u, e = e}
          l.gone[#l.gone + 1] = all[j]
        else
          l.last = max(l.last, e)
        end
      end
      table.sort(ended, function(a, b) return a.e < b.e end)
      l.t = t
      for _, x in ipairs(ended) do
        -- Until x expired, the bucket held at most limit - out: t >= x.e + out * interval.
        l.t = max(l.t, x.e + l.out * interval)
        l.out = l.out - x.u
      end
      leases[i] = l
    end
    return max(t, l.t), l.out
  end

  -- The algorithms, one function each, return what decide returns.

  -- bucket decides token bucket i (kind 1) or leaky bucket i (kind 2).
  local function bucket(i, kind, cost, limit, rate, period, maxwait)
    local allowed, retry, wait, write = false, 0, 0, nil
    local interval = period / rate
    local span = limit * interval
    local v = redis.call('GET', keys[i])
    local t = 0
    if v then t = struct.unpack('<d', v) end
    -- The units leased out are the bucket's too: it holds at most limit - out of its own.
    local out
    t, out = leased(i, t, interval)
    local full = now + out * interval
    local nt = t
    if kind == 1 then
      local base = max(t, full)
      local need = base - now + cost * interval
      allowed = need <= span + SLACK_US
      if allowed then
        if cost > 0 then nt = later(base, cost * interval) end
      else
        retry = us(need - span)
      end
    else
      local start = max(t, now)
      local w = start - now
      local own = cost * interval
      allowed = w + own <= span + SLACK_US and w <= maxwait + SLACK_US
      if allowed then
        wait = us(w)
        if cost > 0 then nt = later(start, own) end
      else
        retry = us(start - min(span - own, maxwait) - now)
      end
    end
    local ahead = max(nt, full) - now
    if allowed and cost > 0 then write = {struct.pack('<d', nt)} end
    if leases[i] then leases[i].nt = max(nt, full) end
    return allowed, min(limit, max(0, floor((span - ahead) / interval))), us(ahead), retry, wait, write
  end

  -- fixedWindow decides the fixed window of key.
  local function fixedWindow(key, cost, limit, period)
    local retry, reset, write = 0, 0, nil
    local idx = floor(now / period)
    local v = tonumber(redis.call('GET', key) or nil)
    local n = 0
    if v then
      local w = floor(v / FW_SHIFT)
      if w == idx % FW_WINDOWS then n = v - w * FW_SHIFT end
    end
    local ending = (idx + 1) * period - now
    local allowed = n + cost <= limit
    if allowed then
      if cost > 0 then
        n = n + cost
        write = {fmt((idx % FW_WINDOWS) * FW_SHIFT + n)}
      end
    else
      retry = us(ending)
    end
    if n > 0 then reset = us(ending) end
    return allowed, min(limit, max(0, limit - n)), reset, retry, 0, write
  end

  -- slidingWindow decides the sliding window counter of key.
  local function slidingWindow(key, cost, limit, period)
    local retry, reset, write = 0, 0, nil
    local idx = floor(now / period)
    local start = idx * period
    local cur, prev = 0, 0
    local v = redis.call('GET', key)
    if v then
      local w, c, p = swcRead(v)
      local n = tonumber(v)
      if (n and w == idx % SW_WINDOWS) or (not n and w == idx) then
        cur, prev = c, p
      elseif (n and w == (idx - 1) % SW_WINDOWS) or (not n and w == idx - 1) then
        prev = c
      end
    end
    -- The previous window's weighted part counts as none once it is worth half a unit or less
    -- (LAST_SHARE, as enforcer/algorithm's windowEstimate).
    local weighted = prev * (period - (now - start)) / period
    if weighted <= LAST_SHARE + SLACK_UNITS then weighted = 0 end
    local est = weighted + cur
    local allowed = est + cost <= limit + SLACK_UNITS
    if allowed then
      if cost > 0 then
        cur = cur + cost
        est = est + cost
        write = {swcWrite(idx, cur, prev)}
      end
    elseif limit - cur - cost >= 0 then
      local room = max(limit - cur - cost, LAST_SHARE)
      retry = us(start + period - room * period / prev - now)
    else
      retry = us(start + period + max(0, period - (limit - cost) * period / cur) - now)
    end
    if cur > 0 then
      reset = us(start + 2 * period - now)
    elseif prev > 0 then
      reset = us(start + period - now)
    end
    return allowed, min(limit, max(0, floor(limit - est))), reset, retry, 0, write
  end

  -- logRetry is when a sliding log of n units admits cost more: once its oldest entries holding
  -- n+cost-limit units have left the window. At most that many entries, each of one unit or more,
  -- are read, in pages.
  local function logRetry(key, n, cost, limit, period)
    local need, from, at = n + cost - limit, 1, nil
    while not at do
      local e = redis.call('ZRANGE', key, from, from + 63, 'WITHSCORES')
      if #e == 0 then error('sluice: sliding log ' .. key .. ' holds fewer units than its total') end
      for j = 1, #e, 2 do
        need = need - units(e[j])
        if need <= 0 then at = tonumber(e[j + 1]) break end
      end
      from = from + 64
    end
    return us(at + period - now)
  end

  -- slidingLog decides the sliding log of key.
  local function slidingLog(key, cost, limit, period)
    local retry, reset, write = 0, 0, nil
    local n = trimmed(key, now - period)
    local allowed = cost <= limit - n
    local newest
    if allowed then
      if cost > 0 then
        n = n + cost
        newest = now
        write = {n}
      end
    else
      retry = logRetry(key, n, cost, limit, period)
    end
    if not newest and n > 0 then
      newest = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
    end
    if newest then reset = us(newest + period - now) end
    return allowed, limit - n, reset, retry, 0, write
  end

  -- concurrency decides the concurrency limit of key, whose leases last period.
  local function concurrency(key, cost, limit, period)
    local write
    local n = trimmed(key, now)
    -- A refusal has no retry: a slot frees when a request in flight ends, which no clock says.
    local allowed = cost <= limit - n
    local latest = 0
    if allowed and cost > 0 then
      n = n + cost
      latest = now + period
      write = {n}
    end
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    if last[2] then latest = max(latest, tonumber(last[2])) end
    return allowed, limit - n, us(latest - now), 0, 0, write
  end

  function decide(i, cost)
    local b = B + (i - 1) * W
    local kind, limit, period = tonumber(argv[b]), tonumber(argv[b + 1]), tonumber(argv[b + 3])
    if kind == 1 or kind == 2 then
      return bucket(i, kind, cost, limit, tonumber(argv[b + 2]), period, tonumber(argv[b + 4]))
    elseif kind == 3 then
      return fixedWindow(keys[i], cost, limit, period)
    elseif kind == 5 then
      return slidingWindow(keys[i], cost, limit, period)
    elseif kind == 4 then
      return slidingLog(keys[i], cost, limit, period)
    elseif kind == 6 then
      return concurrency(keys[i], cost, limit, period)
    end
    error('sluice: unknown algorithm ' .. tostring(argv[b]))
  end
end

-- evaluate is decide, but a cost the rule can never admit is refused first, as a cost-0 check
-- sees the rule, with retry_us NEVER.
local function evaluate(i, cost)
  local limit = tonumber(argv[B + (i - 1) * W + 1])
  if cost < 0 or cost > limit then
    local _, remaining, reset = decide(i, 0)
    return false, remaining, reset, NEVER, 0, nil
  end
  return decide(i, cost)
end

local function enforced(i) return arg(i, 6) == '1' end
local function rec(i) return recs[tonumber(arg(i, 7))] end
local function deferred(i) return arg(i, 8) == '1' end

-- keep stores what rule i charged, r = {evaluate(...)}, for the request named member. A
-- decision that names one rule twice charges it once, the last cost, as the memory store's last
-- write wins: logged holds the member each sorted set was given.
local function keep(i, r, member, cost)
  local kind, key, reset = tonumber(arg(i, 0)), keys[i], r[3]
  if kind == 4 or kind == 6 then
    if logged[key] then redis.call('ZREM', key, logged[key]) end
    logged[key] = member .. ':' .. cost
    local score = now
    if kind == 6 then score = now + tonumber(arg(i, 3)) end
    redis.call('ZADD', key, fmt(score), logged[key], fmt(r[6][1] - LOG_BASE), '#')
    redis.call('PEXPIRE', key, ttl(reset))
  else
    redis.call('SET', key, r[6][1], 'PX', ttl(reset))
  end
end

local function reply(res)
  local out = {1, now}
  for i = 1, n do
    local r = res[i]
    out[#out + 1] = r[1] and 1 or 0
    out[#out + 1] = r[2]
    out[#out + 1] = r[3]
    out[#out + 1] = r[4]
    out[#out + 1] = r[5]
    out[#out + 1] = 0
  end
  return out
end

-- giveBack returns to fixed window i the units of a lease its enforcer never used, if their
-- window is still the current one. (A token bucket's are never given back: the bucket may have
-- been full since they were taken, and a credit would make more than one bucket.)
local function giveBack(i)
  local back = tonumber(arg(i, 12))
  if back <= 0 or tonumber(arg(i, 0)) ~= 3 then return end
  local v = redis.call('GET', keys[i])
  if not v then return end
  local period = tonumber(arg(i, 3))
  local idx, w = floor(now / period), floor(tonumber(v) / FW_SHIFT)
  if floor(tonumber(arg(i, 13)) / period) == idx and w == idx % FW_WINDOWS then
    local c = tonumber(v) - w * FW_SHIFT
    redis.call('SET', keys[i], fmt(w * FW_SHIFT + max(0, c - back)), 'KEEPTTL')
  end
end

-- finish: the response has ended. Each rule in turn, never refusing: a concurrency limit's
-- lease is released; any other rule is charged the cost its response reported, at most what
-- it has left now (algorithm.Limit.Charge), so a larger cost takes it to exhaustion.
local function finish()
  local res = {}
  for i = 1, n do
    local cost = tonumber(arg(i, 5))
    if tonumber(arg(i, 0)) == 6 then
      decide(i, 0) -- drops the expired leases
      if redis.call('ZREM', keys[i], id .. ':' .. cost) == 1 then
        redis.call('ZINCRBY', keys[i], fmt(-cost), '#')
      end
      res[i] = {evaluate(i, 0)}
    else
      local left = {evaluate(i, 0)}
      local units = min(max(cost, 0), left[2])
      res[i] = {evaluate(i, units)}
      -- Charging nothing passes, as algorithm.Limit.Charge: a bucket filled a float step past
      -- its bound refuses even a cost of 0.
      if units == 0 then res[i][1], res[i][4] = true, 0 end
      -- Each charge a sliding log member of its own: a rule charged twice holds both.
      if res[i][1] and res[i][6] then keep(i, res[i], id .. '+' .. i, units) end
      logged = {}
    end
  end
  return reply(res)
end

-- renew: a concurrency limit's lease that has not expired runs a lease timeout from now.
local function renew()
  local res = {}
  for i = 1, n do
    if tonumber(arg(i, 0)) == 6 then
      decide(i, 0) -- drops the expired leases
      local member = id .. ':' .. tonumber(arg(i, 5))
      if redis.call('ZSCORE', keys[i], member) then
        redis.call('ZADD', keys[i], fmt(now + tonumber(arg(i, 3))), member)
      end
      res[i] = {evaluate(i, 0)}
      if res[i][3] > 0 then redis.call('PEXPIRE', keys[i], ttl(res[i][3])) end
    else
      res[i] = {evaluate(i, 0)}
    end
  end
  return reply(res)
end

-- The token buckets' leases: the expired ones leave, their bounds kept in the bucket's time; an
-- admitted request that took replaces what its enforcer held (spent by now) by what it took.
local function settleLeases(res, free, commit, granted)
  for i, l in pairs(leases) do
    local r = res[i]
    local charged = commit and r[1] and r[6] and not free[i]
    if #l.gone > 0 then
      redis.call('HDEL', l.key, unpack(l.gone))
      if not charged then
        -- The expired leases' bounds stay in the bucket's time, which only moves on: the same
        -- rule named again in this request may have been charged past them already.
        local v = redis.call('GET', keys[i])
        local t = 0
        if v then t = struct.unpack('<d', v) end
        if l.t > max(t, now) then redis.call('SET', keys[i], struct.pack('<d', l.t), 'PX', ttl(l.t - now)) end
      end
    end
    if commit and r[1] and not free[i] and tonumber(arg(i, 10)) >= 0 then
      local units = (granted[i] or 0) + tonumber(arg(i, 14))
      if units > 0 then
        local e = now + tonumber(arg(i, 11))
        redis.call('HSET', l.key, argv[5], units .. ':' .. fmt(e))
        l.last = max(l.last, e)
      else
        redis.call('HDEL', l.key, argv[5])
      end
    end
    if l.last > 0 then
      local b = B + (i - 1) * W
      local span = tonumber(argv[b + 1]) * tonumber(argv[b + 3]) / tonumber(argv[b + 2])
      redis.call('PEXPIRE', l.key, ttl(l.last - now + span))
    end
  end
end

-- evaluateAll decides every rule of the request: a free repeat of an admitted request passes
-- its record's rules uncharged (free), every other rule is evaluated at its cost. It returns the
-- rules' results, which are free, whether every enforced rule allows (commit) and whether
-- every rule passed free.
local function evaluateAll()
  local res, free = {}, {}
  local commit, all_free = true, true
  for i = 1, n do
    local r = rec(i)
    local cost, limit = tonumber(arg(i, 5)), tonumber(arg(i, 1))
    -- A cost the rule can never admit is no repeat of an admitted request: it is refused as such.
    if r and r.seen and r.seen >= 0 and r.seen < r.free and cost >= 0 and cost <= limit then
      -- A free repeat of an admitted request, for this rule's policy: it passes uncharged.
      free[i] = true
      res[i] = {evaluate(i, 0)}
      res[i][1], res[i][5] = true, 0
    else
      all_free = false
      res[i] = {evaluate(i, tonumber(arg(i, 5)))}
      if enforced(i) and not res[i][1] then commit = false end
      if deferred(i) and res[i][1] then
        -- Charged by the response, not here: it reports its state as it stays.
        res[i] = {evaluate(i, 0)}
        res[i][1] = true
      end
    end
  end
  return res, free, commit, all_free
end

-- refuseRepeat refuses a repeat of a refused request, before that refusal's Retry-After, the
-- same way, and reports whether it did. The limits refuse it already unless they changed; if
-- none does, the first enforced rule of the record's policy refuses it until the record ends.
local function refuseRepeat(res)
  local refused = false
  for j, r in ipairs(recs) do
    if r.seen and r.seen < 0 then
      for i = 1, n do
        if not refused and enforced(i) and tonumber(arg(i, 7)) == j then
          res[i] = {evaluate(i, 0)}
          res[i][1], res[i][4], res[i][5] = false, max(1, redis.call('PTTL', r.key)) * 1000, 0
          refused = true
        end
      end
    end
  end
  return refused
end

-- takeAhead is the units leased, by rule, of an admitted request: a rule asked to take charges up
-- to that many units more, as many as it has left, for the enforcer to decide later requests
-- from.
local function takeAhead(res, free)
  local granted = {}
  for i = 1, n do
    local take, r = tonumber(arg(i, 10)), res[i]
    if take > 0 and r[1] and not free[i] and enforced(i) and not deferred(i) then
      local extra = min(take, r[2])
      if extra > 0 then
        local more = {evaluate(i, tonumber(arg(i, 5)) + extra)}
        if more[1] then res[i], granted[i] = more, extra end
      end
    end
  end
  return granted
end

-- answer is the reply to a decision (the header's Returns), the longest retry_us of its enforced
-- refusals, and whether one of them can never pass.
local function answer(res, free, commit, all_free, granted)
  local out = {commit and (all_free and 2 or 1) or 0, now}
  local retry_max, never = 0, false
  for i = 1, n do
    local r = res[i]
    local cost = tonumber(arg(i, 5))
    if not commit and r[1] and not free[i] and cost > 0 then
      -- Nothing is charged, so a rule that would have allowed reports its state as it stays.
      r = {evaluate(i, 0)}
      r[1] = true
    end
    if not r[1] and enforced(i) then
      retry_max = max(retry_max, r[4])
      never = never or r[4] == NEVER
    end
    out[#out + 1] = r[1] and (free[i] and 2 or 1) or 0
    out[#out + 1] = r[2]
    out[#out + 1] = r[3]
    out[#out + 1] = r[4]
    out[#out + 1] = r[5]
    out[#out + 1] = granted[i] or 0
  end
  return out, retry_max, never
end

-- refuse records a refused request: the leases settled, and, for its first refusal, its records
-- refuse its repeats until its Retry-After. A request that can never pass leaves no record: its
-- repeats are refused as it was.
local function refuse(res, free, granted, retry_max, never)
  settleLeases(res, free, false, granted)
  for _, r in ipairs(recs) do
    if not r.seen and not never then
      redis.call('SET', r.key, '-1', 'PX', ttl(retry_max))
    end
  end
end

-- charge charges an admitted request: its records count it, each rule not passed free keeps
-- what it charged, and the leases are settled.
local function charge(res, free, granted)
  for _, r in ipairs(recs) do
    if r.seen then
      redis.call('SET', r.key, fmt(r.seen + 1), 'KEEPTTL') -- a repeat, free or charged
    else
      redis.call('SET', r.key, '0', 'PX', r.window)
    end
  end
  for i = 1, n do
    local r = res[i]
    if r[1] and r[6] and not free[i] then keep(i, r, id, tonumber(arg(i, 5))) end
  end
  settleLeases(res, free, true, granted)
end

-- decideRequest decides the request: every rule checked, all charged or none, and the leases
-- taken and settled.
local function decideRequest()
  for i = 1, n do giveBack(i) end
  local res, free, commit, all_free = evaluateAll()
  if commit and refuseRepeat(res) then commit = false end
  local granted = {}
  if commit then granted = takeAhead(res, free) end
  local out, retry_max, never = answer(res, free, commit, all_free, granted)
  if commit then
    charge(res, free, granted)
  else
    refuse(res, free, granted, retry_max, never)
  end
  return out
end

-- run decides a call of the script: its keys and arguments as the header describes.
local function run(k, a)
  floor, ceil, max, min = math.floor, math.ceil, math.max, math.min
  keys, argv = k, a
  if argv[1] ~= '' then
    now = tonumber(argv[1])
  else
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  id = argv[2]
  n = (#argv - B + 1) / W
  leases, logged, recs = {}, {}, {}
  for w, f in string.gmatch(argv[3], '(%d+):(%d+)') do
    recs[#recs + 1] = {window = tonumber(w), free = tonumber(f)}
  end
  nrecs = #recs
  for j, r in ipairs(recs) do
    r.key = keys[n + j]
    r.seen = tonumber(redis.call('GET', r.key) or nil)
  end
  local mode = argv[4]
  if mode == 'f' then return finish() end
  if mode == 'r' then return renew() end
  return decideRequest()
end
