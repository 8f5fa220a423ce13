package idemtest

import (
	"fmt"
	"strings"
)

// Scenario names, in the order a check runs them. An External handler has no
// transaction to roll back, so its second and third scenarios are the external
// counterparts (LostResponse, CrashAfterPerform) of the in-transaction ones
// (CrashBeforeCommit, CrashAfterCommit).
const (
	FirstDelivery     = "first delivery"
	CrashBeforeCommit = "crash after the effect, before commit"
	LostResponse      = "error after the effect reached the downstream"
	CrashAfterCommit  = "crash after commit, before ack"
	CrashAfterPerform = "crash after the effect, before its outcome was recorded"
	Redelivery        = "broker redelivery of the same stream message"
	Resent            = "re-sent with a new Nats-Msg-Id"
	ChangedPayload    = "same key, changed payload"
)

// Report is what a check found, scenario by scenario.
type Report struct {
	// Consumer is the consumer's name, Key the Case's key (Message.Key or the one
	// minted for it).
	Consumer, Key string
	// Scenarios are the scenarios that ran, in order.
	Scenarios []Scenario
	// NotRun names the scenarios that did not run because an earlier one halted
	// the check (its wait ran out, or the first delivery failed, on which every
	// later scenario rests).
	NotRun []string
}

// Scenario is the outcome of one scenario.
type Scenario struct {
	// Name is one of the scenario name constants.
	Name string
	// Key is the key whose effects were counted: the Case's key, or a fresh one
	// for the crash scenarios.
	Key string
	// Effects is the count Case.Effects returned for Key after the scenario; Want
	// is what exactly once requires (1).
	Effects, Want int
	// OK reports whether the scenario held.
	OK bool
	// Detail says, for a failed scenario, what went wrong and what it means for
	// the handler; it is empty for one that held.
	Detail string
}

// OK reports whether every scenario ran and held.
func (r Report) OK() bool {
	return len(r.Failed()) == 0 && len(r.NotRun) == 0 && len(r.Scenarios) > 0
}

// Failed returns the scenarios that did not hold.
func (r Report) Failed() []Scenario {
	var out []Scenario
	for _, s := range r.Scenarios {
		if !s.OK {
			out = append(out, s)
		}
	}
	return out
}

// Scenario returns the scenario named name, if it ran.
func (r Report) Scenario(name string) (Scenario, bool) {
	for _, s := range r.Scenarios {
		if s.Name == name {
			return s, true
		}
	}
	return Scenario{}, false
}

// String formats the report one scenario a line.
func (r Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "idemtest: consumer %s, key %q\n", r.Consumer, r.Key)
	for _, s := range r.Scenarios {
		b.WriteString(s.String())
		b.WriteByte('\n')
	}
	for _, n := range r.NotRun {
		fmt.Fprintf(&b, "NOT RUN %s\n", n)
	}
	return b.String()
}

// String formats the scenario on one line: ok or FAIL, its name, the counts and,
// for a failure, the detail.
func (s Scenario) String() string {
	status := "ok  "
	if !s.OK {
		status = "FAIL"
	}
	line := fmt.Sprintf("%s %s: effects %d, want %d", status, s.Name, s.Effects, s.Want)
	if s.Detail != "" {
		line += ": " + s.Detail
	}
	return line
}
