#!/usr/bin/env bash
# Runs one fuzz target for a time: hack/fuzz.sh PACKAGE TARGET FUZZTIME. It fails when the
# target fails on an input, which Go writes to the target's testdata/fuzz/ as a reproducer.
#
# Go 1.26's fuzz coordinator can report the end of -fuzztime itself as a failure, a bare
# "context deadline exceeded" with no input written, when a worker is busy as the time runs out
# (golang/go#75804, fixed in Go 1.27). That, and only that, is said and not counted as a failure.
set -uo pipefail
pkg=$1 name=$2 fuzztime=$3
dir=$(go list -f '{{.Dir}}' "$pkg")/testdata/fuzz/$name
before=$(ls "$dir" 2>/dev/null | sort)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
go test -run '^$' -fuzz "^$name\$" -fuzztime "$fuzztime" -fuzzminimizetime 10s "$pkg" 2>&1 | tee "$out"
status=${PIPESTATUS[0]}
[[ $status -eq 0 ]] && exit 0
after=$(ls "$dir" 2>/dev/null | sort)
if [[ "$before" == "$after" ]] && grep -q '^    context deadline exceeded$' "$out" && ! grep -q 'Failing input written' "$out"; then
	echo "fuzz $pkg $name: the coordinator reported its own deadline with no failing input (golang/go#75804); not a failure"
	exit 0
fi
exit "$status"
