package install_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/natstest"
	"github.com/idemkit/idem/internal/testkit/pgtest"
)

// The stream is the user's: an installation requires its name and subjects,
// EnsureStream creates it with the defaults when absent, and leaves an existing one
// as its operator tuned it.
func TestEnsureStream(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ns := natstest.Start(t)
	nc, err := nats.Connect(ns.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for name, cfg := range map[string]install.Stream{
		"no name":         {Subjects: []string{"orders.>"}},
		"no subjects":     {Name: "ORDERS"},
		"bad filter":      {Name: "ORDERS", Subjects: []string{"orders..x"}},
		"negative MaxAge": {Name: "ORDERS", Subjects: []string{"orders.>"}, MaxAge: -time.Hour},
	} {
		if err := cfg.Validate(); err == nil {
			t.Errorf("%s: Validate accepted %+v", name, cfg)
		}
		if _, err := install.New(db.Pool, nc, install.Config{Stream: cfg}); err == nil {
			t.Errorf("%s: install.New accepted %+v", name, cfg)
		}
	}
	if _, err := js.Stream(ctx, "ORDERS"); err == nil {
		t.Fatal("a refused configuration created a stream")
	}

	orders := install.Stream{Name: "ORDERS", Subjects: []string{"orders.>"}}
	tablesOnly, err := install.New(db.Pool, nil, install.Config{Stream: orders})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tablesOnly.EnsureStream(ctx); err == nil {
		t.Fatal("EnsureStream without a NATS connection: want an error")
	}

	inst, err := install.New(db.Pool, nc, install.Config{Stream: orders})
	if err != nil {
		t.Fatal(err)
	}
	s, err := inst.EnsureStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if c := info.Config; c.MaxAge != install.DefaultStreamMaxAge || c.Duplicates != install.DefaultDuplicateWindow ||
		len(c.Subjects) != 1 || c.Subjects[0] != "orders.>" || c.Storage != jetstream.FileStorage {
		t.Fatalf("created stream = %+v, want the defaults on orders.>", c)
	}
	// An existing stream is not reconfigured.
	orders.MaxAge = time.Hour
	inst, err = install.New(db.Pool, nc, install.Config{Stream: orders})
	if err != nil {
		t.Fatal(err)
	}
	s, err = inst.EnsureStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info, err = s.Info(ctx); err != nil || info.Config.MaxAge != install.DefaultStreamMaxAge {
		t.Fatalf("existing stream MaxAge = %s (%v), want it left at %s", info.Config.MaxAge, err, install.DefaultStreamMaxAge)
	}
}
