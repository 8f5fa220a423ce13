package refapp_test

import (
	"context"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// newAppEnv is a test world with the application's tables and its stream.
func newAppEnv(t *testing.T) *testenv.Env {
	t.Helper()
	env := testenv.New(t)
	if err := refapp.Migrate(context.Background(), env.DB.Pool); err != nil {
		t.Fatal(err)
	}
	if _, err := appInstall(t, env, nil).EnsureStream(context.Background()); err != nil {
		t.Fatal(err)
	}
	return env
}

// appInstall is the application's installation in env (its stream), with obs
// told every event.
func appInstall(t *testing.T, env *testenv.Env, obs idem.Observer) *install.Installation {
	t.Helper()
	return env.Install(t, func(c *install.Config) {
		c.Stream = install.Stream{Name: refapp.StreamName, Subjects: []string{refapp.StreamSubjects}}
		c.Observer = obs
	})
}

// ledgerRows counts ledger_entries rows for a scoped key.
func ledgerRows(t *testing.T, env *testenv.Env, key string) int {
	t.Helper()
	return env.DB.Count(t, `SELECT count(*) FROM ledger_entries WHERE idempotency_key = $1`, key)
}
