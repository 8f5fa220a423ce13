package refapp_test

import (
	"context"
	"testing"

	"github.com/idemkit/idem/internal/app/refapp"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// newAppEnv is a test world with the application's tables and its stream.
func newAppEnv(t *testing.T) *testenv.Env {
	t.Helper()
	env := testenv.New(t)
	if err := refapp.Migrate(context.Background(), env.DB.Pool); err != nil {
		t.Fatal(err)
	}
	if _, err := outbox.EnsureStream(context.Background(), env.JS, outbox.StreamConfig{
		Name: refapp.StreamName, Subjects: []string{refapp.StreamSubjects}}); err != nil {
		t.Fatal(err)
	}
	return env
}

// ledgerRows counts ledger_entries rows for a scoped key.
func ledgerRows(t *testing.T, env *testenv.Env, key string) int {
	t.Helper()
	return env.DB.Count(t, `SELECT count(*) FROM ledger_entries WHERE idempotency_key = $1`, key)
}
