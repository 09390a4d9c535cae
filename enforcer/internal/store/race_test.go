//go:build race

package store_test

// raceEnabled: the race detector drops a share of what sync.Pool is given, so an allocation
// count under it is an average above zero.
const raceEnabled = true
