#!/usr/bin/env bash
# Envoy's rate limit service (gRPC), side by side in one run, on loopback, with ghz as the client
# for every target: Sluice's --rls-listen on the memory store and on a standalone Redis, the
# no-decision ceiling (bench/ceiling -mode rls: a grpc-go server of the same API that answers OK),
# and, when RATELIMIT is set, envoyproxy/ratelimit's gRPC service on the same Redis. Each call is
# one descriptor of one of 10,000 random clients; the targets take turns, ROUNDS times.
#
# Needs redis-server and ghz (go install github.com/bojand/ghz/cmd/ghz@v0.93.0; GHZ names it when
# it is not on PATH). RATELIMIT is the path of a ratelimit binary built from envoyproxy/ratelimit
# (go build ./src/service_cmd in its checkout); it is not built here.
# Usage: bench/rls.sh [seconds per run, default 8] [rounds, default 3]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-8} rounds=${2:-3}
ghz=${GHZ:-ghz}
for bin in "$ghz" redis-server redis-cli; do
	command -v "$bin" >/dev/null || { echo "bench/rls.sh needs $bin (see the comment at its top)" >&2; exit 1; }
done

work=$(mktemp -d)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	rm -rf "$work"
}
trap cleanup EXIT

REDIS=18285 MEM=18286 RED=18287 CEIL=18288 PEER=18289 PEER_HTTP=18290 PEER_DEBUG=18291 MEM_PROXY=18292 RED_PROXY=18293
go build -o "$work/enforcer" ./cmd/enforcer
go build -o "$work/ceiling" ./bench/ceiling
go run ./bench/protoset >"$work/rls.protoset"

redis-server --port $REDIS --bind 127.0.0.1 --save "" --appendonly no --daemonize no >/dev/null &
pids+=($!)

# The proxy, which every enforcer runs, gets an upstream that is never called.
"$work/enforcer" --policy bench/policy.yaml --listen 127.0.0.1:$MEM_PROXY --upstream http://127.0.0.1:9 --check-listen "" --admin-listen "" \
	--rls-listen 127.0.0.1:$MEM 2>"$work/enf-mem.log" &
pids+=($!)
"$work/enforcer" --policy bench/policy.yaml --listen 127.0.0.1:$RED_PROXY --upstream http://127.0.0.1:9 --check-listen "" --admin-listen "" \
	--rls-listen 127.0.0.1:$RED --redis-url redis://127.0.0.1:$REDIS/0 --redis-timeout 200ms 2>"$work/enf-redis.log" &
pids+=($!)
"$work/ceiling" -mode rls -listen 127.0.0.1:$CEIL 2>/dev/null &
pids+=($!)
targets=("sluice-memory:$MEM:bench/bench" "sluice-redis:$RED:bench/bench" "ceiling:$CEIL:bench/bench")
if [[ -n ${RATELIMIT:-} ]]; then
	mkdir -p "$work/runtime/ratelimit/config"
	cat >"$work/runtime/ratelimit/config/bench.yaml" <<EOF
domain: bench
descriptors:
  - key: x-client
    rate_limit: {unit: second, requests_per_unit: 4000000000}
EOF
	USE_STATSD=false LOG_LEVEL=warn REDIS_SOCKET_TYPE=tcp REDIS_URL=127.0.0.1:$REDIS \
		RUNTIME_ROOT="$work/runtime" RUNTIME_SUBDIRECTORY=ratelimit RUNTIME_WATCH_ROOT=false \
		HOST=127.0.0.1 PORT=$PEER_HTTP GRPC_HOST=127.0.0.1 GRPC_PORT=$PEER DEBUG_HOST=127.0.0.1 DEBUG_PORT=$PEER_DEBUG \
		"$RATELIMIT" 2>"$work/peer.log" &
	pids+=($!)
	targets+=("envoyproxy-ratelimit:$PEER:bench")
fi
sleep 2

echo "# $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(go version | cut -d' ' -f3), redis $(redis-server --version | grep -o 'v=[0-9.]*' | cut -d= -f2)"
echo "# ghz -c50 --connections 50 -z ${secs}s, one descriptor of 10,000 random clients per call; calls/s (OK answers only)"
for round in $(seq "$rounds"); do
	line="round $round:"
	for t in "${targets[@]}"; do
		IFS=: read -r name port domain <<<"$t"
		out=$("$ghz" --insecure --protoset "$work/rls.protoset" \
			--call envoy.service.ratelimit.v3.RateLimitService.ShouldRateLimit \
			-c 50 --connections 50 -z "${secs}s" --format json \
			-d '{"domain":"'"$domain"'","descriptors":[{"entries":[{"key":"x-client","value":"{{randomInt 0 10000}}"}]}]}' \
			127.0.0.1:"$port")
		# OK answers per second of the run; other codes are listed when more than the calls in
		# flight that the end of the run cancels (Canceled, Unavailable) have them.
		line+=" $(echo "$out" | python3 -c '
import json, sys
r = json.load(sys.stdin)
codes = r.get("statusCodeDistribution", {})
out = "%s %.0f/s" % (sys.argv[1], codes.get("OK", 0) / (r["total"] / 1e9))
other = {c: n for c, n in codes.items() if c != "OK"}
if sum(other.values()) > 100:
    out += " (%s)" % other
print(out)' "$name")"
	done
	echo "$line"
done
