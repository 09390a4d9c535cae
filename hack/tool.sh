#!/usr/bin/env bash
# Prints the path of a tool that its users run and the tests run too (helm, promtool, traefik),
# built once per machine into a cache outside the repository. helm and promtool share the test
# cluster's module (hack/envtest.sh builds them with it: they need the same Kubernetes libraries,
# compiled once); traefik, whose Kubernetes libraries are older and whose dependency graph must not
# move the cluster's, has a module of its own, hack/tools/traefik/go.mod.
#
# Usage: hack/tool.sh helm|promtool|traefik
set -euo pipefail

tool=${1:?usage: hack/tool.sh helm|promtool|traefik}
here=$(cd "$(dirname "$0")" && pwd)
case "$tool" in
helm | promtool)
	# The test cluster's cache when it is built; otherwise this tool alone, from the same module
	# and flags (hack/envtest.sh's build finds its packages in Go's build cache then).
	if assets=$("$here/envtest.sh" --if-built); then
		echo "$assets/$tool"
		exit 0
	fi
	mod="$here/envtest"
	pkg=$(cd "$mod" && go list -f '{{.ImportPath}}' tool | grep "/$tool\$" || true)
	[[ -n "$pkg" ]] || { echo "hack/tool.sh: hack/envtest/go.mod has no tool $tool" >&2; exit 2; }
	# Keyed by the whole module, whose pins all go into the tool.
	version="$tool-$("$here/envtest.sh" --digest)"
	;;
*)
	mod="$here/tools/$tool"
	[[ -f "$mod/go.mod" ]] || { echo "hack/tool.sh: no tool $tool (no $mod/go.mod)" >&2; exit 2; }
	pkg=$(awk '$1 == "tool" {print $2}' "$mod/go.mod")
	# The cache is keyed by the tool's module and version as go.mod pins them: a new pin builds anew.
	version=$(cd "$mod" && go list -m -f '{{.Path}}@{{.Version}}' "$(cd "$mod" && go list -f '{{.Module.Path}}' "$pkg")")
	;;
esac
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
