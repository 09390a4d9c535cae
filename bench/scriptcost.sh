#!/usr/bin/env bash
# What one decision costs Redis, alone: redis-benchmark runs each script by EVALSHA with the
# arguments of one token bucket rule (the enforcer's, enforcer/internal/store/redis.go), on
# 100,000 random keys, and INFO commandstats gives Redis's own microseconds per call. The scripts
# run from the cheapest to Sluice's: return 1 (the Redis ceilings' script, bench/ceiling), TIME
# alone, the three calls any exact decision with a TTL makes, a token bucket alone written for
# speed, and enforcer/internal/store/scripts/decide.lua as the store runs it: by EVALSHA (as on
# a Redis without functions, its helpers made on every call) and by FCALL of its library (made
# once, at FUNCTION LOAD).
#
# Needs redis-server, redis-cli and redis-benchmark (Debian: apt-get install redis-server).
# Usage: bench/scriptcost.sh [calls per script, default 300000]
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-300000}
port=18395
work=$(mktemp -d)
redis-server --port $port --bind 127.0.0.1 --save "" --appendonly no --daemonize no >/dev/null &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$work"' EXIT
sleep 0.5

echo 'return 1' >"$work/return-1.lua"
echo "redis.call('TIME') return 1" >"$work/time.lua"
cat >"$work/time-get-set.lua" <<'LUA'
local t = redis.call('TIME')
redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], 'x', 'PX', 1000)
return {1, tonumber(t[1])}
LUA
cat >"$work/lean-token-bucket.lua" <<'LUA'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local limit, rate, period, cost = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[11])
local interval = period / rate
local span = limit * interval
local v = redis.call('GET', KEYS[1])
local tat = 0
if v then tat = struct.unpack('<d', v) end
local base = math.max(tat, now)
local allowed = base - now + cost * interval <= span + 1
local nt = tat
if allowed then nt = base + cost * interval end
local ahead = math.max(nt, now) - now
local remaining = math.min(limit, math.max(0, math.floor((span - ahead) / interval)))
local reset = math.ceil(ahead)
if allowed then redis.call('SET', KEYS[1], struct.pack('<d', nt), 'PX', math.max(1, math.ceil(reset / 1000))) end
return {1, now, allowed and 1 or 0, remaining, reset, 0, 0}
LUA
# As enforcer/internal/store/scripts.go wraps it.
{ cat enforcer/internal/store/scripts/decide.lua; echo 'return run(KEYS, ARGV)'; } >"$work/decide.lua"
{ echo '#!lua name=sluice_bench'; cat enforcer/internal/store/scripts/decide.lua
  echo "redis.register_function('sluice_bench', function(keys, args) return run(keys, args) end)"; } >"$work/decide-fcall.lua"

echo "# $(date -u +%FT%TZ) $(nproc) cores, redis $(redis-server --version | grep -o 'v=[0-9.]*' | cut -d= -f2), redis-benchmark -P 16 -c 20 -n $calls"
for s in return-1 time time-get-set lean-token-bucket decide decide-fcall; do
	redis-cli -p $port flushall >/dev/null
	redis-cli -p $port function flush >/dev/null
	if [[ $s == decide-fcall ]]; then
		redis-cli -p $port function load "$(cat "$work/$s.lua")" >/dev/null
		cmd=(FCALL sluice_bench)
	else
		cmd=(EVALSHA "$(redis-cli -p $port script load "$(cat "$work/$s.lua")")")
	fi
	redis-cli -p $port config resetstat >/dev/null
	# ARGV as the store sends one rule (decide.lua's header): now (from TIME), request id,
	# records, mode, enforcer, then kind 1 (token bucket), limit, rate, period (µs), max wait,
	# cost, enforce, record, deferred, leases, take (-1: no lease), expiry, back, back_us, hold,
	# spent. decide.lua must answer one rule's six fields after its two, allowed: else the
	# arguments no longer match it and the run would time a script that decides nothing.
	args=('{1}:r' '' req1 '' d e1 1 1000000000 1000000000 1000000 0 1 1 0 0 0 -1 0 0 0 0 0)
	if [[ $s == decide* ]]; then
		reply=$(redis-cli -p $port "${cmd[@]}" 1 "${args[@]}" | tr '\n' ' ')
		[[ $reply =~ ^1\ [0-9]+\ 1\ [0-9]+\ [0-9]+\ 0\ 0\ 0\ $ ]] || { echo "$s answered '$reply' to one token bucket: its arguments changed, update this script" >&2; exit 1; }
		redis-cli -p $port flushall >/dev/null
	fi
	args[0]='{__rand_int__}:r'
	redis-benchmark -p $port -q -n "$calls" -c 20 -P 16 -r 100000 "${cmd[@]}" 1 "${args[@]}" >/dev/null
	stat=$(tr '[:upper:]' '[:lower:]' <<<"${cmd[0]}")
	printf '%-18s %s µs per call\n' "$s" "$(redis-cli -p $port info commandstats | tr -d '\r' | awk -F'usec_per_call=' "/^cmdstat_$stat:/ {split(\$2, a, \",\"); print a[1]}")"
done
