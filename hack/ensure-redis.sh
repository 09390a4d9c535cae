#!/usr/bin/env bash
# Makes sure redis-server and redis-cli are installed. The tests start their own servers on
# loopback ports; they never use a Redis that is already running.
set -euo pipefail
if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
	exit 0
fi
if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
	echo "Installing redis-server with apt-get..." >&2
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
	exit 0
fi
echo "The tests need redis-server and redis-cli (Redis 7 or newer) on PATH." >&2
echo "Install them: 'sudo apt-get install redis-server' (Debian, Ubuntu) or 'brew install redis' (macOS)." >&2
exit 1
