//go:build race

package main

// raceEnabled says the tests run with the race detector, under which
// sync.Pool drops what it is given at random and allocations are not the
// code's own.
const raceEnabled = true
