#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver and etcd) from Go modules, once per machine, into a
# cache outside the repository, and prints the directory to use as KUBEBUILDER_ASSETS.
# setup-envtest cannot download here; the Go module proxy is the only source of binaries.
# A preset KUBEBUILDER_ASSETS that holds both binaries wins.
set -euo pipefail

K8S_VERSION=1.37.2
here=$(cd "$(dirname "$0")" && pwd)

if [[ -n "${KUBEBUILDER_ASSETS:-}" && -x "$KUBEBUILDER_ASSETS/kube-apiserver" && -x "$KUBEBUILDER_ASSETS/etcd" ]]; then
	echo "$KUBEBUILDER_ASSETS"
	exit 0
fi

dir="${XDG_CACHE_HOME:-$HOME/.cache}/sluice/k8s/$K8S_VERSION"
if [[ -x "$dir/kube-apiserver" && -x "$dir/etcd" ]]; then
	echo "$dir"
	exit 0
fi

mkdir -p "$dir"
# One build at a time per machine: a second caller waits for the first and then uses its result.
exec 9>"$dir/.lock"
flock 9
if [[ -x "$dir/kube-apiserver" && -x "$dir/etcd" ]]; then
	echo "$dir"
	exit 0
fi
echo "Building kube-apiserver and etcd $K8S_VERSION into $dir (once per machine; 15-20 minutes on 2 cores)..." >&2
cd "$here/envtest"
tmp=$(mktemp -d "$dir/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$tmp/kube-apiserver" ./kube-apiserver >&2
CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$tmp/etcd" ./etcd >&2
# Move into place only when both are built, so an interrupted build is never mistaken for a cache.
mv "$tmp/etcd" "$dir/etcd"
mv "$tmp/kube-apiserver" "$dir/kube-apiserver"
echo "$dir"
