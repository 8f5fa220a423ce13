package reconcile_test

import (
	"context"
	"testing"

	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// A row the pass found lost, but which its consumer settled before the re-drive
// was written, is not re-driven, and is left for the next pass to complete: its
// log relay window must not be marked proven with it, or nothing would judge it
// again and it would stay unproven for ever.
func TestARowSettledBeforeItsRedriveIsCompletedNextPass(t *testing.T) {
	t.Parallel()
	b := setup(t, options{})
	b.register(t, "c", testenv.Subject)
	b.publish(t, testenv.Subject, "k-1")
	if err := b.streamHandle(t).Purge(context.Background()); err != nil {
		t.Fatal(err)
	}
	settleMeanwhile := faults.New().Func(faults.ReconcileBeforeRedrive, func(ctx context.Context, _ []string) error {
		_, err := b.env.DB.Pool.Exec(ctx, `INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, completed_at, expires_at)
			SELECT 'c', key, subject, '\x00', 'done', now(), now() + interval '72 hours' FROM idem_outbox WHERE key = 'k-1'`)
		return err
	})
	rep, err := b.rec.Pass(faults.With(context.Background(), settleMeanwhile))
	if err != nil {
		t.Fatal(err)
	}
	if rep.Redriven != 0 {
		t.Fatalf("first pass = %+v; want nothing re-driven: c settled the row before the re-drive", rep)
	}
	if rep := b.pass(t); rep.Completed != 1 {
		t.Fatalf("second pass = %+v; want the row completed", rep)
	}
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE key = 'k-1' AND completed_at IS NOT NULL`); n != 1 {
		t.Fatalf("completed rows of k-1 = %d, want 1", n)
	}
}
