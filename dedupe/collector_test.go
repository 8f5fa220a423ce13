package dedupe_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/internal/pgtest"
)

// The collector deletes expired rows only: live keys, unpublished outbox rows and
// unexpired requests stay.
func TestCollectorDeletesOnlyExpiredRows(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	exec := func(sql string) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	// 2500 expired and 10 live inbox rows.
	exec(`INSERT INTO idem_inbox (consumer, key, fingerprint, status, expires_at)
	      SELECT 'c', 'old-' || g, '\x00', 'done', now() - interval '1 second' FROM generate_series(1, 2500) g`)
	exec(`INSERT INTO idem_inbox (consumer, key, fingerprint, status, expires_at)
	      SELECT 'c', 'live-' || g, '\x00', 'done', now() + interval '1 hour' FROM generate_series(1, 10) g`)
	exec(`INSERT INTO idem_requests (scope, key, fingerprint, method, path, expires_at) VALUES
	      ('', 'old', '\x00', 'POST', '/', now() - interval '1 second'),
	      ('', 'live', '\x00', 'POST', '/', now() + interval '1 hour')`)
	// Outbox: published+expired (goes), published+live (stays), unpublished with an
	// old expires_at (stays: it has not been delivered yet).
	exec(`INSERT INTO idem_outbox (key, subject, msg_id, payload, published_at, expires_at) VALUES
	      ('a', 'idem.x', 'a', '\x00', now(), now() - interval '1 second'),
	      ('b', 'idem.x', 'b', '\x00', now(), now() + interval '1 hour'),
	      ('c', 'idem.x', 'c', '\x00', NULL, now() - interval '1 second')`)

	c := dedupe.NewCollector(db.Pool, dedupe.CollectorConfig{BatchSize: 1000})
	start := time.Now()
	n, err := c.CollectOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("deleted %d rows in %s", n, time.Since(start))
	if n != 2500+1+1 {
		t.Errorf("deleted %d rows, want 2502", n)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox`); got != 10 {
		t.Errorf("inbox rows left = %d, want the 10 live ones", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_inbox WHERE key LIKE 'live-%'`); got != 10 {
		t.Errorf("live inbox rows left = %d, want 10", got)
	}
	if got := db.Count(t, `SELECT count(*) FROM idem_requests WHERE key = 'live'`); got != 1 {
		t.Errorf("live request gone")
	}
	var kept string
	if err := db.Pool.QueryRow(ctx, `SELECT string_agg(key, ',' ORDER BY key) FROM idem_outbox`).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	if kept != "b,c" {
		t.Errorf("outbox keeps %q, want b (live) and c (unpublished)", kept)
	}
}

func TestLifetimeInvariant(t *testing.T) {
	t.Parallel()
	ok := dedupe.Lifetimes{InboxKey: 72 * time.Hour, RequestKey: 48 * time.Hour, StreamMaxAge: 24 * time.Hour, Redelivery: 15 * time.Minute, ClientResend: 24 * time.Hour}
	if err := ok.Check(); err != nil {
		t.Fatalf("defaults rejected: %v", err)
	}
	cases := []struct {
		name   string
		mutate func(*dedupe.Lifetimes)
		want   string
	}{
		{"inbox shorter than stream", func(l *dedupe.Lifetimes) { l.InboxKey = 12 * time.Hour }, "inbox key lifetime 12h0m0s must be longer than the stream's MaxAge 24h0m0s"},
		{"unlimited stream", func(l *dedupe.Lifetimes) { l.StreamMaxAge = 0 }, "stream MaxAge is unlimited"},
		{"redelivery longer", func(l *dedupe.Lifetimes) { l.Redelivery = 100 * time.Hour }, "redelivery horizon 100h0m0s"},
		{"client longer than inbox", func(l *dedupe.Lifetimes) { l.ClientResend = 96 * time.Hour }, "the client's re-send horizon 96h0m0s"},
		{"client longer than requests", func(l *dedupe.Lifetimes) { l.ClientResend = 50 * time.Hour }, "request key lifetime 48h0m0s must be longer than the client's re-send horizon 50h0m0s"},
	}
	for _, tc := range cases {
		l := ok
		tc.mutate(&l)
		err := l.Check()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to mention %q", tc.name, err, tc.want)
		}
	}
}
