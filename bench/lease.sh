#!/usr/bin/env bash
# Leased units (issue 32, point 3), side by side in one run, on loopback: one hot client across
# three enforcers, each enforcer driven by its own wrk at the same time, for
#   a. the memory store (each enforcer decides alone: the reference),
#   b. one standalone Redis, bench/policy.yaml (every decision one script),
#   c. the same Redis, bench/lease.yaml (the same rule with lease: {max: 100, expiry: 1s}),
# first through the check API (/forward-auth), then through the proxy (an nginx upstream returning
# 200). Reported per store: requests per second summed over the three wrks, the worst of their
# three p99s, answers other than 2xx, decisions that failed open (a Redis call past
# --redis-timeout admits unchecked: counted from the enforcers' metrics, as a 200 hides it), Redis
# scripts per request (FCALL, EVALSHA and EVAL calls in INFO commandstats over the requests of the
# run) and the rate as a share of the memory store's, which runs first and again last (the mean of
# both).
# wrk is closed-loop: the rate is what this machine sustains with everything on its cores.
#
# Needs wrk, nginx, redis-server and curl (Debian: apt-get install wrk nginx-light redis-server curl).
# Usage: bench/lease.sh [seconds per run, default 10]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
for bin in wrk nginx redis-server redis-cli curl; do
	command -v "$bin" >/dev/null || { echo "bench/lease.sh needs $bin (apt-get install wrk nginx-light redis-server curl)" >&2; exit 1; }
done

work=$(mktemp -d)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	nginx -p "$work" -c nginx.conf -s stop 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT

UP=18380 REDIS=18381
# Each store's three enforcers: proxy ports base+0..2, check ports base+3..5, admin base+6..8.
declare -A base=([memory]=18390 [redis]=18400 [redis-lease]=18410)
go build -o "$work/enforcer" ./cmd/enforcer

mkdir -p "$work/logs"
cat >"$work/nginx.conf" <<EOF
worker_processes 1;
error_log $work/logs/error.log;
pid $work/nginx.pid;
events { worker_connections 4096; }
http {
  access_log off;
  server { listen 127.0.0.1:$UP; location / { return 200 "ok\n"; } }
}
EOF
nginx -p "$work" -c nginx.conf

redis-server --port $REDIS --bind 127.0.0.1 --save "" --appendonly no --daemonize no >/dev/null &
pids+=($!)

# up waits, at most 10 s, until something listens on the port.
up() {
	for _ in $(seq 100); do
		(exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
		sleep 0.1
	done
	echo "nothing listens on 127.0.0.1:$1" >&2
	tail -n 5 "$work"/logs/*.log >&2
	exit 1
}
up $REDIS

for store in memory redis redis-lease; do
	policy=bench/policy.yaml args=()
	[[ $store == memory ]] || args=(--redis-url "redis://127.0.0.1:$REDIS/0" --redis-timeout 200ms)
	[[ $store == redis-lease ]] && policy=bench/lease.yaml
	for i in 0 1 2; do
		"$work/enforcer" --policy "$policy" --upstream "http://127.0.0.1:$UP" \
			--listen "127.0.0.1:$((base[$store] + i))" --check-listen "127.0.0.1:$((base[$store] + 3 + i))" \
			--admin-listen "127.0.0.1:$((base[$store] + 6 + i))" --shutdown-delay 0s "${args[@]}" 2>"$work/logs/enf-$store-$i.log" &
		pids+=($!)
	done
done
for store in memory redis redis-lease; do
	for i in $(seq 0 8); do up $((base[$store] + i)); done
done

# failedOpen STORE prints the decisions its three enforcers admitted because Redis did not answer.
failedOpen() {
	for i in 0 1 2; do curl -sf "http://127.0.0.1:$((base[$1] + 6 + i))/metrics"; done |
		awk '/^sluice_decisions_total\{.*result="failed_open"/ {n += $NF} END {printf "%d\n", n}'
}
calls() { redis-cli -p $REDIS info commandstats | awk -F'[=,:]' '/cmdstat_(eval|evalsha|fcall):/ {n += $3} END {print n + 0}'; }
# sum FILES... prints requests/s, requests, the worst p99 in ms, answers other than 2xx or 3xx, and
# socket errors, over the wrk outputs.
sum() {
	awk '
		/Requests\/sec/ {rate += $2}
		/requests in/ {n += $1}
		$1 == "99%" {
			v = $2 + 0
			if ($2 ~ /us$/) v /= 1000; else if ($2 ~ /[0-9]s$/) v *= 1000; else if ($2 ~ /m$/) v *= 60000
			if (v > p99) p99 = v
		}
		/Non-2xx or 3xx/ {bad += $NF}
		/Socket errors/ {gsub(/,/, ""); errs += $4 + $6 + $8 + $10}
		END {printf "%d %d %.2f %d %d\n", rate, n, p99, bad, errs}' "$@"
}

echo "# $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(go version | cut -d' ' -f3), $(nginx -v 2>&1 | cut -d/ -f2), redis $(redis-server --version | grep -o 'v=[0-9.]*' | cut -d= -f2), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# per store three enforcers, each driven at once by its own wrk -t1 -c16 -d${secs}s --latency; one client (X-Client: hot)"
printf '%-9s %-12s %10s %13s %8s %8s %12s %16s %9s\n' "front end" store "req/s" "worst p99 ms" "non-2xx" errors "failed open" "scripts/request" "/ memory"
failed=0
for front in check proxy; do
	# The memory store runs first and again last: the machine's rate drifts through a run, and
	# the others are reported as a share of the mean of the two.
	rates=() rows=()
	for store in memory redis redis-lease memory; do
		before=$(calls) openBefore=$(failedOpen "$store")
		wrks=()
		for i in 0 1 2; do
			if [[ $front == check ]]; then
				url="http://127.0.0.1:$((base[$store] + 3 + i))/forward-auth"
			else
				url="http://127.0.0.1:$((base[$store] + i))/"
			fi
			timeout $((secs + 30)) wrk -t1 -c16 -d"${secs}s" --latency -H "X-Client: hot" \
				-H "X-Forwarded-Method: GET" -H "X-Forwarded-Uri: /" "$url" >"$work/wrk-$i.out" &
			wrks+=($!)
		done
		for p in "${wrks[@]}"; do wait "$p"; done
		after=$(calls) open=$(( $(failedOpen "$store") - openBefore ))
		read -r r n p99 bad errs < <(sum "$work"/wrk-{0,1,2}.out)
		(( bad + errs + open == 0 )) || failed=1
		rates+=("$r")
		rows+=("$(printf '%-9s %-12s %10d %13s %8d %8d %12d %16s' "$front" "$store" "$r" "$p99" "$bad" "$errs" "$open" \
			"$(awk -v a="$after" -v b="$before" -v n="$n" 'BEGIN {printf "%.4f", (a - b) / n}')")")
	done
	memory=$(( (rates[0] + rates[3]) / 2 ))
	for i in "${!rows[@]}"; do
		printf '%s %9s\n' "${rows[$i]}" "$(awk -v r="${rates[$i]}" -v m="$memory" 'BEGIN {printf "%.2fx", r / m}')"
	done
done
if (( failed )); then
	echo "some answers were not 2xx, wrk had socket errors, or decisions failed open: a 429 means the limit was reached, a decision failed open that Redis did not answer within --redis-timeout" >&2
	exit 1
fi
