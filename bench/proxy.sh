#!/usr/bin/env bash
# Proxy and check-API benchmarks, side by side in one run, on loopback: the upstream directly
# (nginx returning 200), nginx as a reverse proxy with limit_req, and each of the enforcer's paths
# right after its ceiling (the same server doing everything but the decision): the memory proxy
# after a bare fasthttp proxy, the Redis proxy and the check API (10,000 random clients) after a
# fasthttp proxy and server that run one trivial pipelined Redis script per request. First with
# wrk (closed loop: throughput, and the CPU time per request of every process that served it,
# with the shares of issue 32's targets), then with bench/loadgen at fixed rates (latency at the
# same offered load): half of the memory enforcer's rate, and half of the Redis enforcer's own;
# last, Go's other servers without a decision. nginx runs as many workers as the machine has
# cores (worker_processes auto), as the enforcer runs as many threads.
#
# Needs wrk, nginx and redis-server (Debian: apt-get install wrk nginx-light redis-server).
# Usage: bench/proxy.sh [seconds per run, default 10]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
for bin in wrk nginx redis-server redis-cli; do
	command -v "$bin" >/dev/null || { echo "bench/proxy.sh needs $bin (apt-get install wrk nginx-light redis-server)" >&2; exit 1; }
done

work=$(mktemp -d)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	# The enforcers drain before they exit: wait, so the next run finds the ports free.
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	nginx -p "$work" -c nginx.conf -s stop 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT

UP=18180 NGINX_RL=18181 ENF_MEM=18182 ENF_REDIS=18183 CHECK=18184 REDIS=18185
go build -o "$work/enforcer" ./cmd/enforcer
go build -o "$work/loadgen" ./bench/loadgen
go build -o "$work/ceiling" ./bench/ceiling

mkdir -p "$work/logs"
cat >"$work/nginx.conf" <<EOF
worker_processes auto;
error_log $work/logs/error.log;
pid $work/nginx.pid;
events { worker_connections 4096; }
http {
  access_log off;
  limit_req_zone \$binary_remote_addr zone=perip:10m rate=1000000r/s;
  upstream app { server 127.0.0.1:$UP; keepalive 256; }
  server { listen 127.0.0.1:$UP; location / { return 200 "ok\n"; } }
  server {
    listen 127.0.0.1:$NGINX_RL;
    location / {
      limit_req zone=perip burst=1000000 nodelay;
      proxy_pass http://app;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
EOF
nginx -p "$work" -c nginx.conf

redis-server --port $REDIS --bind 127.0.0.1 --save "" --appendonly no --daemonize no >/dev/null &
pids+=($!)
redis_pid=$!

# bench/policy.yaml: the proxy runs decide one client (wrk's one address, as nginx's zone sees
# it), the check API runs 10,000 random X-Client keys, as real traffic does.
"$work/enforcer" --policy bench/policy.yaml --upstream http://127.0.0.1:$UP --listen 127.0.0.1:$ENF_MEM \
	--check-listen "" --admin-listen "" 2>"$work/logs/enf-mem.log" &
pids+=($!)
mem_pid=$!
"$work/enforcer" --policy bench/policy.yaml --upstream http://127.0.0.1:$UP --listen 127.0.0.1:$ENF_REDIS \
	--check-listen 127.0.0.1:$CHECK --admin-listen "" --redis-url redis://127.0.0.1:$REDIS/0 --redis-timeout 200ms \
	2>"$work/logs/enf-redis.log" &
pids+=($!)
redis_enf_pid=$!
# running what pids...: stops the run when a server exited at its start (a port taken).
running() {
	local what=$1 p
	shift
	for p in "$@"; do
		kill -0 "$p" 2>/dev/null || { echo "bench/proxy.sh: $what did not start: is one of its ports taken?" >&2; exit 1; }
	done
}
sleep 1
running "Redis or an enforcer (ports $UP-$REDIS)" $redis_pid $mem_pid $redis_enf_pid
nginx_pids=$(pgrep -P "$(cat "$work/nginx.pid")" | xargs)

rate() { awk '/Requests\/sec/ {print $2}'; }
p99() { awk '$1 == "99%" {print $2}'; }

# Where a closed-loop run's CPU goes: each process's user and system time per request, in µs, from
# /proc (the server under test, nginx as the upstream or the peer, Redis) and wrk's own from bash's
# time. On two shared cores, what each process spends per request sets the rate.
tick_us=$((1000000 / $(getconf CLK_TCK)))
ticks() { local t=0 p; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo "$t"; }
# wrkcpu server-pids -- wrk arguments...: runs wrk; sets out (its report) and cpu (per request).
wrkcpu() {
	local server=()
	while [[ $1 != -- ]]; do server+=("$1"); shift; done
	shift
	local s0 n0 r0 s1 n1 r1 t
	s0=$(ticks "${server[@]}") n0=$(ticks $nginx_pids) r0=$(ticks "$redis_pid")
	t=$( { TIMEFORMAT='%U %S'; time wrk "$@" >"$work/wrk.out"; } 2>&1 )
	s1=$(ticks "${server[@]}") n1=$(ticks $nginx_pids) r1=$(ticks "$redis_pid")
	out=$(cat "$work/wrk.out")
	local n
	n=$(echo "$out" | awk '/requests in/ {print $1}')
	cpu=$(awk -v n="$n" -v u="$tick_us" -v s=$((s1 - s0)) -v g=$((n1 - n0)) -v r=$((r1 - r0)) -v w="$t" \
		'BEGIN {split(w, x, " "); printf "server %.1f, nginx %.1f, Redis %.1f, wrk %.1f", s*u/n, g*u/n, r*u/n, (x[1]+x[2])*1e6/n}')
	if [[ ${server[*]} == "$nginx_pids" ]]; then cpu=${cpu/server*, nginx/nginx}; fi
}

# The bare fasthttp proxy and the Redis paths' ceilings run beside the enforcers from the start, so
# that each path is measured right after its ceiling: the machine's rate drifts through a run, and
# only adjacent runs make a share. fastproxy-redis and fastcheck-redis run one trivial script per
# request against the same Redis, pipelined as the enforcer's store sends its scripts: what the
# Redis proxy and the check API could reach with a decision that costs nothing.
CEIL=18186 CEIL_FAST=18187 CEIL_PROXY_REDIS=18188 CEIL_CHECK_REDIS=18189
"$work/ceiling" -mode fastproxy -listen 127.0.0.1:$CEIL_FAST -upstream 127.0.0.1:$UP 2>/dev/null &
pids+=($!)
fast_pid=$!
"$work/ceiling" -mode fastproxy-redis -listen 127.0.0.1:$CEIL_PROXY_REDIS -upstream 127.0.0.1:$UP -redis 127.0.0.1:$REDIS 2>/dev/null &
pids+=($!)
proxy_redis_pid=$!
"$work/ceiling" -mode fastcheck-redis -listen 127.0.0.1:$CEIL_CHECK_REDIS -redis 127.0.0.1:$REDIS 2>/dev/null &
pids+=($!)
check_redis_pid=$!
sleep 0.5
running "a ceiling (ports $CEIL_FAST-$CEIL_CHECK_REDIS)" $fast_pid $proxy_redis_pid $check_redis_pid

cat >"$work/random-client.lua" <<'LUA'
-- Each request describes a request of one of 10,000 clients, drawn at random.
math.randomseed(os.time())
request = function()
  return wrk.format("GET", "/auth-request", {["X-Original-Method"] = "GET", ["X-Original-URL"] = "/", ["X-Client"] = tostring(math.random(10000))})
end
LUA
calls() { redis-cli -p $REDIS info commandstats | awk -F'[=,:]' '/cmdstat_(eval|evalsha|fcall):/ {n += $3} END {print n + 0}'; }

echo "# $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(go version | cut -d' ' -f3), nginx $(nginx -v 2>&1 | cut -d/ -f2) ($(echo $nginx_pids | wc -w) workers), redis $(redis-server --version | grep -o 'v=[0-9.]*' | cut -d= -f2)"
echo "# wrk -t2 -d${secs}s -c64 (-c50 and 10,000 random clients on the check paths), each path right after its ceiling"
printf '%-22s %12s %10s   %s\n' target "wrk req/s" "wrk p99" "CPU µs per request"
declare -A full
for t in "upstream:$UP:$nginx_pids" "nginx-limit_req:$NGINX_RL:$nginx_pids" \
	"ceiling-fastproxy:$CEIL_FAST:$fast_pid" "enforcer-memory:$ENF_MEM:$mem_pid" \
	"ceiling-proxy-redis:$CEIL_PROXY_REDIS:$proxy_redis_pid" "enforcer-redis:$ENF_REDIS:$redis_enf_pid" \
	"ceiling-check-redis:$CEIL_CHECK_REDIS:$check_redis_pid" "check-redis:$CHECK:$redis_enf_pid"; do
	IFS=: read -r name port server <<<"$t"
	if [[ $name == *check* ]]; then
		before=$(calls)
		wrkcpu $server -- -t2 -c50 -d"${secs}s" --latency -s "$work/random-client.lua" "http://127.0.0.1:$port/"
		scripts=$(awk -v a="$(calls)" -v b="$before" -v r="$(echo "$out" | awk '/requests in/ {print $1}')" 'BEGIN {printf "%.3f", (a - b) / r}')
	else
		wrkcpu $server -- -t2 -c64 -d"${secs}s" --latency "http://127.0.0.1:$port/"
	fi
	full[$name]=$(echo "$out" | rate)
	printf '%-22s %12s %10s   %s\n' "$name" "${full[$name]}" "$(echo "$out" | p99)" "$cpu"
done
share() { awk -v a="${full[$1]}" -v b="${full[$2]}" 'BEGIN {printf "%.2fx", a / b}'; }
echo "shares: memory proxy / bare fasthttp proxy $(share enforcer-memory ceiling-fastproxy) (target 0.95x); memory proxy / nginx $(share enforcer-memory nginx-limit_req); Redis proxy / its Redis ceiling $(share enforcer-redis ceiling-proxy-redis) (target 0.85x); check API / its Redis ceiling $(share check-redis ceiling-check-redis) (target 0.85x), Redis scripts per check API request $scripts"

echo "# loadgen -c64 at a fixed rate for ${secs}s: half the memory enforcer's rate, then half the Redis enforcer's"
half=$(awk -v r="${full[enforcer-memory]}" 'BEGIN {printf "%d", r / 2}')
for t in "upstream:$UP" "ceiling-fastproxy:$CEIL_FAST" "enforcer-memory:$ENF_MEM" "enforcer-redis:$ENF_REDIS" "ceiling-proxy-redis:$CEIL_PROXY_REDIS" "nginx-limit_req:$NGINX_RL"; do
	name=${t%%:*} port=${t##*:}
	printf '%-22s at %d/s: %s\n' "$name" "$half" "$("$work/loadgen" -url "http://127.0.0.1:$port/" -rate "$half" -duration "${secs}s")"
done
# Issue 32's tail target is at half of the Redis enforcer's own rate: p99 at most 3x nginx's.
halfRedis=$(awk -v r="${full[enforcer-redis]}" 'BEGIN {printf "%d", r / 2}')
for t in "enforcer-redis:$ENF_REDIS" "ceiling-proxy-redis:$CEIL_PROXY_REDIS" "nginx-limit_req:$NGINX_RL"; do
	name=${t%%:*} port=${t##*:}
	printf '%-22s at %d/s: %s\n' "$name" "$halfRedis" "$("$work/loadgen" -url "http://127.0.0.1:$port/" -rate "$halfRedis" -duration "${secs}s")"
done

# What Go's other servers allow on this machine, against the same upstream: net/http alone, the
# leanest net/http HTTP/1.1 proxy, httputil.ReverseProxy with http.Transport, fasthttp alone.
for mode in hello proxy reverseproxy fasthello; do
	"$work/ceiling" -mode $mode -listen 127.0.0.1:$CEIL -upstream 127.0.0.1:$UP 2>/dev/null &
	pid=$!
	sleep 0.5
	wrkcpu $pid -- -t2 -c64 -d"${secs}s" "http://127.0.0.1:$CEIL/"
	printf 'ceiling, %-13s %12s req/s   CPU µs per request: %s\n' "$mode" "$(echo "$out" | rate)" "$cpu"
	kill $pid
	wait $pid 2>/dev/null || true
done
