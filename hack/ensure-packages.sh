#!/usr/bin/env bash
# Makes sure the programs the tests run from Debian's packages are installed, in one apt-get:
#   redis-server and redis-cli: the tests start their own servers on loopback ports, and the node
#     tier's managed Redis image is made of them;
#   nginx: run in front of the enforcer as ingress-nginx configures its auth-url annotations;
#   containerd, runc, the CNI plugins, iptables and conntrack: the node tier's container runtime,
#     pod network and kube-proxy's rules (test/node).
# The tests start their own processes; they never use a server that is already running.
#
# Usage: hack/ensure-packages.sh [COMMAND...]: all of them, or only those that bring COMMANDs
# (make demo needs redis-server alone).
set -euo pipefail

# command -> the package that brings it.
declare -A packages=(
	[redis-server]=redis-server [redis-cli]=redis-tools
	[nginx]=nginx-light
	[containerd]=containerd [ctr]=containerd [runc]=runc
	[/usr/lib/cni/bridge]=containernetworking-plugins
	[iptables]=iptables [conntrack]=conntrack
)
wanted=("$@")
[[ ${#wanted[@]} -gt 0 ]] || wanted=("${!packages[@]}")
missing=()
for cmd in "${wanted[@]}"; do
	[[ -n "${packages[$cmd]:-}" ]] || { echo "hack/ensure-packages.sh: no package for $cmd" >&2; exit 2; }
	if ! command -v "$cmd" >/dev/null && [[ ! -x "$cmd" ]]; then
		missing+=("${packages[$cmd]}")
	fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
readarray -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
	echo "Installing ${missing[*]} with apt-get..." >&2
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
	exit 0
fi
echo "The tests need these Debian packages: ${missing[*]}." >&2
echo "Install them: 'sudo apt-get install ${missing[*]}' (Debian, Ubuntu)." >&2
exit 1
