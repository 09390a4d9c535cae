#!/usr/bin/env bash
# Runs every fuzz target of the repository for a time each: hack/fuzz.sh FUZZTIME. It fails when a
# target fails on an input, which Go writes to the target's testdata/fuzz/ as a reproducer.
#
# The targets are the `func FuzzX(f *testing.F)` of the test files git knows. Each package's test
# binary is built once, instrumented for fuzzing (go test -c -fuzz), and runs each of its targets
# in turn from the package's directory, as go test -fuzz would: one build and one link a package
# rather than one a target, and no test binary built and run only to list its targets.
#
# Go 1.26's fuzz coordinator can report the end of -fuzztime itself as a failure, a bare
# "context deadline exceeded" with no input written, when a worker is busy as the time runs out
# (golang/go#75804, fixed in Go 1.27). That, and only that, is said and not counted as a failure.
set -uo pipefail
fuzztime=${1:?usage: hack/fuzz.sh FUZZTIME}
cd "$(dirname "$0")/.."

# "dir name" for each target.
targets=$(git ls-files -- '*_test.go' | xargs grep -H '^func Fuzz[A-Za-z0-9_]*(f \*testing\.F)' |
	sed -E 's|^(.*)/[^/]*_test\.go:func (Fuzz[A-Za-z0-9_]*)\(.*|\1 \2|' | sort -u)
if [[ -z "$targets" ]]; then
	echo "hack/fuzz.sh: no fuzz targets found" >&2
	exit 1
fi
bin=$(mktemp -d)
out=$(mktemp)
trap 'rm -rf "$bin" "$out"' EXIT
cache=$(go env GOCACHE)/fuzz

for dir in $(cut -d' ' -f1 <<<"$targets" | sort -u); do
	test=$bin/$(tr / _ <<<"$dir").test
	if ! go test -c -fuzz=. -o "$test" "./$dir"; then
		echo "hack/fuzz.sh: cannot build the fuzz test binary of ./$dir" >&2
		exit 1
	fi
	for name in $(awk -v d="$dir" '$1 == d { print $2 }' <<<"$targets"); do
		echo "--- fuzz ./$dir $name for $fuzztime"
		before=$(ls "$dir/testdata/fuzz/$name" 2>/dev/null | sort)
		(cd "$dir" && "$test" -test.run='^$' -test.fuzz="^$name\$" -test.fuzztime="$fuzztime" \
			-test.fuzzminimizetime=10s -test.fuzzcachedir="$cache" -test.timeout=10m) 2>&1 | tee "$out"
		status=${PIPESTATUS[0]}
		[[ $status -eq 0 ]] && continue
		after=$(ls "$dir/testdata/fuzz/$name" 2>/dev/null | sort)
		if [[ "$before" == "$after" ]] && grep -q '^    context deadline exceeded$' "$out" && ! grep -q 'Failing input written' "$out"; then
			echo "fuzz ./$dir $name: the coordinator reported its own deadline with no failing input (golang/go#75804); not a failure"
			continue
		fi
		exit "$status"
	done
done
