#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver, etcd, kube-controller-manager) and kubectl from Go
# modules, once per machine, into a cache outside the repository, and prints the directory to use as
# KUBEBUILDER_ASSETS. setup-envtest cannot download here; the Go module proxy is the only source
# of binaries. A preset KUBEBUILDER_ASSETS that holds all four wins.
set -euo pipefail

K8S_VERSION=1.37.2
BINARIES=(kube-apiserver etcd kubectl kube-controller-manager)
here=$(cd "$(dirname "$0")" && pwd)

complete() {
	for bin in "${BINARIES[@]}"; do
		[[ -x "$1/$bin" ]] || return 1
	done
}

if [[ -n "${KUBEBUILDER_ASSETS:-}" ]] && complete "$KUBEBUILDER_ASSETS"; then
	echo "$KUBEBUILDER_ASSETS"
	exit 0
fi

dir="${XDG_CACHE_HOME:-$HOME/.cache}/sluice/k8s/$K8S_VERSION"
if complete "$dir"; then
	echo "$dir"
	exit 0
fi

mkdir -p "$dir"
# One build at a time per machine: a second caller waits for the first and then uses its result.
exec 9>"$dir/.lock"
flock 9
cd "$here/envtest"
tmp=$(mktemp -d "$dir/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# Each binary that is missing is built and moved into place whole, so an interrupted build is never
# mistaken for a cache, and a cache from before kubectl was added only builds kubectl
# (kube-apiserver and etcd: 15-20 minutes on 2 cores; kubectl: about 3; kube-controller-manager,
# after kube-apiserver has filled the module and build caches: under 2).
for bin in "${BINARIES[@]}"; do
	[[ -x "$dir/$bin" ]] && continue
	echo "Building $bin $K8S_VERSION into $dir (once per machine)..." >&2
	CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$tmp/$bin" "./$bin" >&2
	mv "$tmp/$bin" "$dir/$bin"
done
echo "$dir"
