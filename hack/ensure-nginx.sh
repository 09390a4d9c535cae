#!/usr/bin/env bash
# Makes sure nginx is installed: the tests run the real nginx in front of the enforcer, configured
# as ingress-nginx renders its auth-url annotations, to check that refusals reach clients as 429.
# They start their own nginx processes on loopback ports.
set -euo pipefail
if command -v nginx >/dev/null; then
	exit 0
fi
if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
	echo "Installing nginx-light with apt-get..." >&2
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null
	exit 0
fi
echo "The tests need nginx on PATH: 'sudo apt-get install nginx-light' (Debian, Ubuntu) or 'brew install nginx' (macOS)." >&2
exit 1
