// Package chaos is idem's fault-injection suite: it proves "once per intent" the
// way Jepsen-style tests do, with real processes, real kills, an independent
// checker and a negative control that shows the checker can see a failure.
//
// Everything lives in the _test.go files; see README.md for what a run does, how
// duplicates_folded is counted, and how to run the long soak.
package chaos
