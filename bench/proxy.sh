#!/usr/bin/env bash
# Proxy and check-API benchmarks, side by side in one run, on loopback:
#   1. the upstream directly (nginx returning 200),
#   2. the enforcer with the memory store,
#   3. the enforcer with a standalone Redis,
#   4. nginx as a reverse proxy with limit_req,
# each with wrk (closed loop: throughput) and bench/loadgen at half of the memory enforcer's rate
# (fixed rate: latency of every target at the same offered load), and the Redis enforcer and nginx
# at half of the Redis enforcer's own rate; then the check API with the Redis store at
# concurrency 50, and Redis scripts per request from INFO commandstats; last, the ceilings: Go's
# servers and proxies without a decision, and with a trivial pipelined Redis script per request.
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
worker_processes 1;
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

# bench/policy.yaml: the proxy runs decide one client (wrk's one address, as nginx's zone sees
# it), the check API runs 10,000 random X-Client keys, as real traffic does.
"$work/enforcer" --policy bench/policy.yaml --upstream http://127.0.0.1:$UP --listen 127.0.0.1:$ENF_MEM \
	--check-listen "" --admin-listen "" 2>"$work/logs/enf-mem.log" &
pids+=($!)
"$work/enforcer" --policy bench/policy.yaml --upstream http://127.0.0.1:$UP --listen 127.0.0.1:$ENF_REDIS \
	--check-listen 127.0.0.1:$CHECK --admin-listen "" --redis-url redis://127.0.0.1:$REDIS/0 --redis-timeout 200ms \
	2>"$work/logs/enf-redis.log" &
pids+=($!)
sleep 1

rate() { awk '/Requests\/sec/ {print $2}'; }
p99() { awk '$1 == "99%" {print $2}'; }

echo "# $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(go version | cut -d' ' -f3), $(nginx -v 2>&1 | cut -d/ -f2), redis $(redis-server --version | grep -o 'v=[0-9.]*' | cut -d= -f2)"
echo "# wrk -t2 -c64 -d${secs}s, then loadgen -c64 at half the memory enforcer's rate for ${secs}s"
printf '%-22s %12s %10s   %s\n' target "wrk req/s" "wrk p99" "loadgen at half load"
declare -A full
for t in "upstream:$UP" "enforcer-memory:$ENF_MEM" "enforcer-redis:$ENF_REDIS" "nginx-limit_req:$NGINX_RL"; do
	name=${t%%:*} port=${t##*:}
	out=$(wrk -t2 -c64 -d"${secs}s" --latency "http://127.0.0.1:$port/")
	full[$name]=$(echo "$out" | rate)
	printf '%-22s %12s %10s\n' "$name" "${full[$name]}" "$(echo "$out" | p99)"
done
# Half load: half of what the enforcer with the memory store sustains, offered to every target.
half=$(awk -v r="${full[enforcer-memory]}" 'BEGIN {printf "%d", r / 2}')
for t in "upstream:$UP" "enforcer-memory:$ENF_MEM" "enforcer-redis:$ENF_REDIS" "nginx-limit_req:$NGINX_RL"; do
	name=${t%%:*} port=${t##*:}
	printf '%-22s at %d/s: %s\n' "$name" "$half" "$("$work/loadgen" -url "http://127.0.0.1:$port/" -rate "$half" -duration "${secs}s")"
done
# Half of what the enforcer with Redis sustains, offered to it and to nginx (issue 32's tail
# target: p99 at most 3x nginx's there); the Redis proxy's ceiling gets it below.
halfRedis=$(awk -v r="${full[enforcer-redis]}" 'BEGIN {printf "%d", r / 2}')
for t in "enforcer-redis:$ENF_REDIS" "nginx-limit_req:$NGINX_RL"; do
	name=${t%%:*} port=${t##*:}
	printf '%-22s at %d/s: %s\n' "$name" "$halfRedis" "$("$work/loadgen" -url "http://127.0.0.1:$port/" -rate "$halfRedis" -duration "${secs}s")"
done

calls() { redis-cli -p $REDIS info commandstats | awk -F'[=,:]' '/cmdstat_(eval|evalsha|fcall):/ {n += $3} END {print n + 0}'; }
before=$(calls)
cat >"$work/random-client.lua" <<'EOF'
-- Each request describes a request of one of 10,000 clients, drawn at random.
math.randomseed(os.time())
request = function()
  return wrk.format("GET", "/auth-request", {["X-Original-Method"] = "GET", ["X-Original-URL"] = "/", ["X-Client"] = tostring(math.random(10000))})
end
EOF
out=$(wrk -t2 -c50 -d"${secs}s" --latency -s "$work/random-client.lua" "http://127.0.0.1:$CHECK/")
after=$(calls)
requests=$(echo "$out" | awk '/requests in/ {print $1}')
echo "check API, Redis store, 10,000 random clients, wrk -c50: $(echo "$out" | rate) decisions/s, p99 $(echo "$out" | p99), Redis scripts per request $(awk -v a="$after" -v b="$before" -v r="$requests" 'BEGIN {printf "%.3f\n", (a - b) / r}')"

# What Go's servers allow on this machine, against the same upstream: net/http alone, the leanest
# net/http HTTP/1.1 proxy, httputil.ReverseProxy with http.Transport; fasthttp alone, and a
# fasthttp server forwarding with fasthttp's HostClient (no decision at all).
CEIL=18186
for mode in hello proxy reverseproxy fasthello fastproxy; do
	"$work/ceiling" -mode $mode -listen 127.0.0.1:$CEIL -upstream 127.0.0.1:$UP 2>/dev/null &
	pid=$!
	sleep 0.5
	printf 'ceiling, %-13s %12s req/s\n' "$mode" "$(wrk -t2 -c64 -d"${secs}s" "http://127.0.0.1:$CEIL/" | rate)"
	if [[ $mode == *proxy ]]; then
		printf 'ceiling, %-13s at %d/s: %s\n' "$mode" "$half" "$("$work/loadgen" -url "http://127.0.0.1:$CEIL/" -rate "$half" -duration "${secs}s")"
	fi
	kill $pid; wait $pid 2>/dev/null || true
done

# The Redis paths' ceilings: the fasthttp proxy and a fasthttp server answering 200, each running
# one trivial script per request against the same Redis, pipelined as the enforcer's store sends
# its scripts: what the Redis proxy and the check API could reach with a decision that costs
# nothing. The check ceiling gets the check API's 10,000 random clients (its key is X-Client).
"$work/ceiling" -mode fastproxy-redis -listen 127.0.0.1:$CEIL -upstream 127.0.0.1:$UP -redis 127.0.0.1:$REDIS 2>/dev/null &
pid=$!
sleep 0.5
printf 'ceiling, %-13s %12s req/s\n' "proxy-redis" "$(wrk -t2 -c64 -d"${secs}s" "http://127.0.0.1:$CEIL/" | rate)"
printf 'ceiling, %-13s at %d/s: %s\n' "proxy-redis" "$half" "$("$work/loadgen" -url "http://127.0.0.1:$CEIL/" -rate "$half" -duration "${secs}s")"
printf 'ceiling, %-13s at %d/s: %s\n' "proxy-redis" "$halfRedis" "$("$work/loadgen" -url "http://127.0.0.1:$CEIL/" -rate "$halfRedis" -duration "${secs}s")"
kill $pid; wait $pid 2>/dev/null || true
"$work/ceiling" -mode fastcheck-redis -listen 127.0.0.1:$CEIL -redis 127.0.0.1:$REDIS 2>/dev/null &
pid=$!
sleep 0.5
out=$(wrk -t2 -c50 -d"${secs}s" --latency -s "$work/random-client.lua" "http://127.0.0.1:$CEIL/")
echo "ceiling, check-redis, 10,000 random clients, wrk -c50: $(echo "$out" | rate) req/s, p99 $(echo "$out" | p99)"
kill $pid; wait $pid 2>/dev/null || true
