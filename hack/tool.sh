#!/usr/bin/env bash
# Builds a tool that its users run and the tests run too (helm, promtool, traefik), once per
# machine, from the Go module pinned in hack/tools/<tool>/go.mod, into a cache outside the
# repository, and prints the binary's path. Each tool has a module of its own: their dependency graphs are large (Helm's
# Kubernetes libraries, Prometheus's service discoveries, Traefik's providers) and must not move
# the other tools'.
#
# Usage: hack/tool.sh helm|promtool|traefik
set -euo pipefail

tool=${1:?usage: hack/tool.sh helm|promtool|traefik}
here=$(cd "$(dirname "$0")" && pwd)
mod="$here/tools/$tool"
[[ -f "$mod/go.mod" ]] || { echo "hack/tool.sh: no tool $tool (no $mod/go.mod)" >&2; exit 2; }
pkg=$(awk '$1 == "tool" {print $2}' "$mod/go.mod")
# The cache is keyed by the tool's module and version as go.mod pins them: a new pin builds anew.
version=$(cd "$mod" && go list -m -f '{{.Path}}@{{.Version}}' "$(cd "$mod" && go list -f '{{.Module.Path}}' "$pkg")")
dir="${XDG_CACHE_HOME:-$HOME/.cache}/sluice/tools/${version//\//_}"
if [[ -x "$dir/$tool" ]]; then
	echo "$dir/$tool"
	exit 0
fi

mkdir -p "$dir"
# One build at a time per machine: a second caller waits for the first and then uses its result.
exec 9>"$dir/.lock"
flock 9
if [[ ! -x "$dir/$tool" ]]; then
	echo "Building $tool ($version) into $dir (once per machine)..." >&2
	tmp=$(mktemp -d "$dir/.build.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	(cd "$mod" && CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$tmp/$tool" "$pkg") >&2
	mv "$tmp/$tool" "$dir/$tool"
fi
echo "$dir/$tool"
