package idemtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/store"
)

// Check runs every scenario (see the package documentation) against env for c and
// reports what it found. It never calls a testing.T: a scenario that does not hold
// is a failed Scenario in the Report, and the error is for a Case that cannot be
// checked (a missing field, a subject the consumer never sees) or an environment
// that fails (the broker refuses the stream, Effects returns an error). The check
// creates c's stream and deletes it when it ends; the database keeps its rows, to
// inspect. Checks on one Env run one at a time.
func Check(ctx context.Context, env *Env, c Case) (report Report, err error) {
	p, err := newPlan(env, c)
	if err != nil {
		return Report{}, err
	}
	env.checking.Lock()
	defer env.checking.Unlock()

	ck := &check{env: env, p: p, out: &outcomes{name: p.cfg.Name}, counted: map[string]int{}, q: store.New(env.Schema).DeadLetters}
	ck.armFaults()
	report = Report{Consumer: p.cfg.Name, Key: p.msg.Key}

	if err := ck.createStream(ctx); err != nil {
		return report, err
	}
	defer func() {
		err = errors.Join(err, ck.stopConsumer(), ck.deleteStream(context.WithoutCancel(ctx)))
	}()
	if err := ck.startConsumer(ctx); err != nil {
		return report, err
	}

	steps := scenarios(p.external)
	for i, st := range steps {
		ck.halt = false
		s, err := st.run(ctx, ck)
		if err != nil {
			return report, fmt.Errorf("idemtest: scenario %q: %w", st.name, err)
		}
		s.Name = st.name
		report.Scenarios = append(report.Scenarios, s)
		if ck.halt {
			for _, rest := range steps[i+1:] {
				report.NotRun = append(report.NotRun, rest.name)
			}
			break
		}
	}
	return report, nil
}

// AssertOnce runs Check with t's context and fails t with one error per scenario
// that did not hold, naming it and its counts. A Case that cannot be checked fails t
// at once. It returns the report.
func (e *Env) AssertOnce(t testing.TB, c Case) Report {
	t.Helper()
	r, err := Check(t.Context(), e, c)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range r.Failed() {
		t.Errorf("idemtest: consumer %s: %s", r.Consumer, s)
	}
	if len(r.NotRun) > 0 {
		t.Errorf("idemtest: consumer %s: not run after an earlier failure: %s", r.Consumer, strings.Join(r.NotRun, "; "))
	}
	return r
}

// check is one running Check.
type check struct {
	env *Env
	p   *plan
	q   store.DeadLetters
	fs  *faults.Set
	out *outcomes
	run *run // the consumer instance running now

	// shots are the one-off crashes of the second and third scenarios.
	before, after *shot
	// counted is each key's effect count after its own scenario; a later
	// redelivery must leave it unchanged.
	counted map[string]int
	// halt, set by a scenario, stops the check after it.
	halt bool
}

// deadLetters returns the reasons the consumer dead-lettered key with.
func (ck *check) deadLetters(ctx context.Context, key string) ([]string, error) {
	rows, err := ck.env.Pool.Query(ctx, ck.q.Reasons, ck.p.cfg.Name, key)
	if err != nil {
		return nil, fmt.Errorf("read dead letters: %w", err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var r string
		if err := rows.Scan(&r); err != nil {
			return nil, fmt.Errorf("read dead letters: %w", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read dead letters: %w", err)
	}
	return out, nil
}

// mismatchPrefix starts the reason of a fingerprint-mismatch dead letter.
const mismatchPrefix = "fingerprint mismatch"
