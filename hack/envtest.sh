#!/usr/bin/env bash
# Builds the test cluster's binaries from the Go modules pinned in hack/envtest/go.mod, once per
# machine, into a cache outside the repository, and prints the directory (KUBEBUILDER_ASSETS):
#   the control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl;
#   the node tier's node: kubelet, kube-proxy, and CoreDNS for the cluster's DNS;
#   and helm and promtool, which check the chart and the alerts with the tools their users run.
# setup-envtest cannot download here; the Go module proxy is the only source of binaries. They
# share one module, so one go build compiles what they share (client-go, the API types, gRPC)
# once: about 40 minutes of CPU on a cold machine. A preset KUBEBUILDER_ASSETS that holds them
# all wins.
#
# Usage: hack/envtest.sh            build if needed, print the directory
#        hack/envtest.sh --if-built print the directory if it is built, else fail
#        hack/envtest.sh --digest   print the digest of the module that keys the cache
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
mod="$here/envtest"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy coredns helm promtool)
# The packages, in BINARIES' order: the module's own commands, then its tools.
PACKAGES=(./etcd ./kube-apiserver ./kube-controller-manager ./kube-scheduler ./kubectl ./kubelet ./kube-proxy ./coredns
	helm.sh/helm/v4/cmd/helm github.com/prometheus/prometheus/cmd/promtool)

complete() {
	for bin in "${BINARIES[@]}"; do
		[[ -x "$1/$bin" ]] || return 1
	done
}

if [[ "${1:-}" != --digest && -n "${KUBEBUILDER_ASSETS:-}" ]] && complete "$KUBEBUILDER_ASSETS"; then
	echo "$KUBEBUILDER_ASSETS"
	exit 0
fi

# The cache is keyed by the Kubernetes version and a digest of the module (its pins and its
# commands), so that a new pin or command builds anew and an old cache is never taken for it.
k8s=$(awk '$1 == "k8s.io/kubernetes" {print $2; exit}' "$mod/go.mod")
digest=$(cd "$mod" && cat go.mod go.sum */main.go | sha256sum | cut -c1-12)
dir="${XDG_CACHE_HOME:-$HOME/.cache}/sluice/k8s/${k8s#v}-$digest"
case "${1:-}" in
--digest)
	echo "$digest"
	exit 0
	;;
--if-built)
	complete "$dir" && echo "$dir"
	exit
	;;
esac
if complete "$dir"; then
	echo "$dir"
	exit 0
fi

mkdir -p "$dir"
# One build at a time per machine: a second caller waits for the first and then uses its result.
exec 9>"$dir/.lock"
flock 9
if ! complete "$dir"; then
	echo "Building the test cluster's binaries ${BINARIES[*]} ($k8s) into $dir (once per machine)..." >&2
	tmp=$(mktemp -d "$dir/.build.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	started=$SECONDS
	(cd "$mod" && CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$tmp/" "${PACKAGES[@]}") >&2
	# Moved into place whole, so an interrupted build is never mistaken for a cache.
	for bin in "${BINARIES[@]}"; do
		mv "$tmp/$bin" "$dir/$bin"
	done
	echo "Built the test cluster's binaries in $((SECONDS - started)) s." >&2
fi
echo "$dir"
