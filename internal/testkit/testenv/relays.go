package testenv

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/relay"
)

// Relays is the relay a test publishes its outbox with, as a worker would choose
// it: the log relay where the server and the role allow it, with the polling
// relay beside it for the rows that are its own then; else the polling relay
// alone. The same tests run with both: `make test` runs them once as a role that
// may replicate and once as one that may not (pgtest, IDEM_TEST_RELAY=poll).
type Relays struct {
	Mode relay.Mode
	Poll *relay.Relay
	Log  *relay.LogRelay

	env  *Env
	inst *install.Installation
}

// StartRelays builds the relays of inst's outbox with cfg and, for the log relay,
// runs it until the test ends, returning once it reads its slot.
func (e *Env) StartRelays(t testing.TB, inst *install.Installation, cfg relay.Config) *Relays {
	t.Helper()
	c, err := relay.LogCapability(context.Background(), e.DB.Pool, e.schema)
	if err != nil {
		t.Fatal(err)
	}
	r := &Relays{Mode: c.Mode, env: e, inst: inst}
	if c.Mode == relay.ModePoll {
		if r.Poll, err = relay.New(parts.Of(inst), cfg); err != nil {
			t.Fatal(err)
		}
		return r
	}
	behind := cfg
	behind.BehindLog = true
	if r.Poll, err = relay.New(parts.Of(inst), behind); err != nil {
		t.Fatal(err)
	}
	if r.Log, err = relay.NewLog(parts.Of(inst), cfg, r.Poll.Wake); err != nil {
		t.Fatal(err)
	}
	Go(t, "log relay", r.Log.Run)
	Eventually(t, 30*time.Second, "the log relay reads its slot", r.Log.Reading)
	return r
}

// Drain publishes every row written so far: the polling relay's at once; the
// log relay's as its slot streams them, waited for until a window holds each
// (or it was handed over, then published by the polling relay).
func (r *Relays) Drain(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	if _, err := r.Poll.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if r.Log == nil {
		return
	}
	Eventually(t, 30*time.Second, "the log relay publishes every row", func() bool {
		return r.env.DB.Count(t, pgschema.Qualify(r.inst.Schema(), sqlUnwindowed)) == 0
	})
	if _, err := r.Poll.Drain(ctx); err != nil {
		t.Fatal(err)
	}
}

// sqlUnwindowed counts the log relay's rows that no window holds yet.
const sqlUnwindowed = `
SELECT count(*) FROM idem_outbox o
WHERE o.relay = 'log' AND o.dead_lettered_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM idem_outbox_published w WHERE w.id_range @> o.id AND o.id = ANY(w.ids))`

// RequireLogRelay skips a test of the log relay itself in the polling pass
// (IDEM_TEST_RELAY=poll), and fails it where the server cannot run the log relay
// otherwise: the suite needs wal_level = logical (.ci/run sets it).
func (e *Env) RequireLogRelay(t testing.TB) {
	t.Helper()
	if os.Getenv("IDEM_TEST_RELAY") == "poll" {
		t.Skip("IDEM_TEST_RELAY=poll: the test role may not replicate")
	}
	c, err := relay.LogCapability(context.Background(), e.DB.Pool, e.schema)
	if err != nil {
		t.Fatal(err)
	}
	if c.Mode != relay.ModeLog {
		t.Fatalf("the log relay cannot run on the test server: %s", c.Why)
	}
}
