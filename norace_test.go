//go:build !race

package main

// raceEnabled says the tests run with the race detector (race_test.go).
const raceEnabled = false
