package relay_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/relay"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// newRelay is a relay of inst's outbox.
func newRelay(t *testing.T, inst *install.Installation, cfg relay.Config) *relay.Relay {
	t.Helper()
	r, err := relay.New(parts.Of(inst), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// enqueue writes msgs in one committed transaction.
func enqueue(t *testing.T, db *pgtest.DB, ob *outbox.Outbox, msgs ...idem.Message) {
	t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, msgs...) }); err != nil {
		t.Fatal(err)
	}
}

// commitBatched writes msgs the way the producer middleware does: AddToBatch,
// sent with the transaction's other statements, no NOTIFY.
func commitBatched(t *testing.T, db *pgtest.DB, ob *outbox.Outbox, msgs ...idem.Message) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		if err := ob.AddToBatch(ctx, b, msgs...); err != nil {
			return err
		}
		return tx.SendBatch(ctx, b).Close()
	})
	if err != nil {
		t.Fatal(err)
	}
}

func msg(key string) idem.Message {
	return idem.Message{Key: key, Subject: testenv.Subject, Payload: []byte(`{"n":1}`)}
}

// onStream is another installation of env's tables, on stream name storing
// subjects, which it creates: an outbox of it accepts subjects the test stream
// does not store.
func onStream(t *testing.T, env *testenv.Env, s install.Stream) *install.Installation {
	t.Helper()
	inst := env.Install(t, func(c *install.Config) { c.Stream = s })
	if _, err := inst.EnsureStream(context.Background()); err != nil {
		t.Fatal(err)
	}
	return inst
}

// refusedInstall asserts that install.New refuses cfg on db: what a relay is
// built on is checked there.
func refusedInstall(t *testing.T, db *pgtest.DB, what string, cfg install.Config) {
	t.Helper()
	if _, err := install.New(db.Pool, nil, cfg); err == nil {
		t.Errorf("%s: install.New accepted %+v", what, cfg)
	}
}
