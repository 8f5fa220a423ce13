package install_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/natstest"
	"github.com/idemkit/idem/outbox"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The stream is the user's: EnsureStream requires its name and subjects, creates it
// with the defaults when absent, and leaves an existing one as its operator tuned it.
func TestEnsureStream(t *testing.T) {
	t.Parallel()
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
	for name, cfg := range map[string]outbox.StreamConfig{
		"no name":         {Subjects: []string{"orders.>"}},
		"no subjects":     {Name: "ORDERS"},
		"bad filter":      {Name: "ORDERS", Subjects: []string{"orders..x"}},
		"negative MaxAge": {Name: "ORDERS", Subjects: []string{"orders.>"}, MaxAge: -time.Hour},
	} {
		if _, err := outbox.EnsureStream(ctx, js, cfg); err == nil {
			t.Errorf("%s: EnsureStream accepted %+v", name, cfg)
		}
	}
	if _, err := js.Stream(ctx, "ORDERS"); err == nil {
		t.Fatal("a refused configuration created a stream")
	}

	s, err := outbox.EnsureStream(ctx, js, outbox.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}})
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if c := info.Config; c.MaxAge != outbox.DefaultStreamMaxAge || c.Duplicates != outbox.DefaultDuplicateWindow ||
		len(c.Subjects) != 1 || c.Subjects[0] != "orders.>" || c.Storage != jetstream.FileStorage {
		t.Fatalf("created stream = %+v, want the defaults on orders.>", c)
	}
	// An existing stream is not reconfigured.
	s, err = outbox.EnsureStream(ctx, js, outbox.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}, MaxAge: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if info, err = s.Info(ctx); err != nil || info.Config.MaxAge != outbox.DefaultStreamMaxAge {
		t.Fatalf("existing stream MaxAge = %s (%v), want it left at %s", info.Config.MaxAge, err, outbox.DefaultStreamMaxAge)
	}
}
