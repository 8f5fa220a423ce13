package worker_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/worker"
)

// lastRelease is the schema version of the last release: what a fleet upgrades
// from.
const lastRelease = 5

// applyUpTo applies the embedded migrations up to and including version last, as
// a worker of that version did, and records them as it did.
func applyUpTo(t *testing.T, db *pgtest.DB, last int) {
	t.Helper()
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, m := range all {
		if m.Version > last {
			break
		}
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS idem_schema_migrations (version int PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name)
			return err
		}); err != nil {
			t.Fatalf("apply %s: %v", m.Name, err)
		}
	}
}

// requestFingerprint is the ingress's fingerprint of a request as the last
// release stored it: SHA-256 over method, target and body, each length-prefixed.
func requestFingerprint(method, target string, body []byte) []byte {
	h := sha256.New()
	var n [8]byte
	for _, part := range [][]byte{[]byte(method), []byte(target), body} {
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write(part)
	}
	return h.Sum(nil)
}

// An upgrade from the last release's schema with intents in flight everywhere a
// v5 fleet leaves them: a message published and in the stream, not yet shipped;
// one committed and still in the outbox; one the old relay published but did not
// mark (it died between the PubAck and its UPDATE); one shipped and settled whose
// message the new durable is delivered again. Today's worker migrates the schema
// and starts: every intent is shipped once, none twice, and the old key's stored
// response is replayed byte for byte.
func TestUpgradeFromTheLastReleaseWithIntentsInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testenv.NewWith(t, pgtest.Options{NoMigrate: true})
	applyUpTo(t, env.DB, lastRelease)
	if _, err := env.DB.Pool.Exec(ctx, sqlOrdersTables); err != nil {
		t.Fatal(err)
	}
	inst := newInst(t, env.DB.Pool, env.NC, ordersInstall(""))
	if _, err := inst.EnsureStream(ctx); err != nil { // the v5 fleet's stream
		t.Fatal(err)
	}

	const subject = "orders.created"
	body := func(key string) string { return fmt.Sprintf(`{"item":"book for %s"}`, key) }
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := env.DB.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// What each request committed under v5: its order, its stored response, its
	// outbox row (published or not).
	storedBody := map[string][]byte{}
	committed := func(key string, published bool) {
		t.Helper()
		storedBody[key] = []byte(fmt.Sprintf(`{"order_id":"v5-%s"}`, key))
		exec(`INSERT INTO public.orders (idem_key, item) VALUES ($1, $2)`, key, "book for "+key)
		exec(`INSERT INTO idem_requests (key, fingerprint, method, path, status, response_code, response_headers, response_body, expires_at)
			VALUES ($1, $2, 'POST', '/orders', 'done', 201, $3, $4, now() + interval '48 hours')`,
			key, requestFingerprint(http.MethodPost, "/orders", []byte(body(key))),
			http.Header{"Content-Type": {"application/json"}, "X-Order": {"v5"}}, storedBody[key])
		var publishedAt any
		if published {
			publishedAt = time.Now()
		}
		exec(`INSERT INTO idem_outbox (key, subject, msg_id, headers, payload, published_at) VALUES ($1, $2, $3, '{}', $4, $5)`,
			key, subject, idem.MsgID(subject, key), []byte(body(key)), publishedAt)
	}
	committed("k-in-stream", true)
	env.Publish(t, subject, "k-in-stream", idem.MsgID(subject, "k-in-stream"), []byte(body("k-in-stream")))
	committed("k-in-outbox", false)
	committed("k-unmarked", false)
	env.Publish(t, subject, "k-unmarked", idem.MsgID(subject, "k-unmarked"), []byte(body("k-unmarked")))
	committed("k-shipped", true)
	env.Publish(t, subject, "k-shipped", idem.MsgID(subject, "k-shipped"), []byte(body("k-shipped")))
	exec(`INSERT INTO public.shipments (order_key, item) VALUES ('k-shipped', 'book for k-shipped')`)
	sum := sha256.Sum256([]byte(body("k-shipped")))
	exec(`INSERT INTO idem_inbox (consumer, key, message, fingerprint, status, completed_at, expires_at) VALUES ('shipping', 'k-shipped', $1, $2, 'done', now(), now() + interval '72 hours')`,
		subject, sum[:])

	// Today's worker, on the same database and stream: it migrates, then runs.
	w, err := worker.New(inst, ordersConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Start(ctx); err != nil {
		t.Fatalf("start on a v5 database: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := w.Stop(ctx); err != nil {
			t.Errorf("Stop: %v", err)
		}
	})
	if err := migrations.Check(ctx, env.DB.Pool, migrations.Config{}); err != nil {
		t.Fatalf("after the upgrade: %v", err)
	}

	keys := []string{"k-in-stream", "k-in-outbox", "k-unmarked", "k-shipped"}
	testenv.Eventually(t, 30*time.Second, "every intent shipped", func() bool {
		return env.DB.Count(t, `SELECT count(DISTINCT order_key) FROM public.shipments`) == len(keys)
	})
	testenv.Eventually(t, 30*time.Second, "the outbox published", func() bool {
		return env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE published_at IS NULL`) == 0
	})
	testenv.Eventually(t, 30*time.Second, "the stream's messages settled", env.DrainedOn(t, "ORDERS", "shipping"))
	for _, k := range keys {
		if n := env.DB.Count(t, `SELECT count(*) FROM public.shipments WHERE order_key = $1`, k); n != 1 {
			t.Errorf("%s shipped %d times, want once", k, n)
		}
	}

	// The old key, retried after the upgrade: the stored response, byte for byte,
	// and nothing run again.
	mux := http.NewServeMux()
	mux.Handle("POST /orders", w.Ingress().Wrap(http.HandlerFunc(createOrder)))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(body("k-in-stream")))
	req.Header.Set(idem.HeaderKey, "k-in-stream")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || !bytes.Equal(got, storedBody["k-in-stream"]) ||
		resp.Header.Get("X-Order") != "v5" || resp.Header.Get(idem.HeaderReplayed) != "true" {
		t.Errorf("the v5 key's retry answered %d %q (X-Order %q, replayed %q); want 201 %q, X-Order v5, replayed",
			resp.StatusCode, got, resp.Header.Get("X-Order"), resp.Header.Get(idem.HeaderReplayed), storedBody["k-in-stream"])
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM public.orders`); n != len(keys) {
		t.Errorf("orders = %d, want %d: a retry ran the handler again", n, len(keys))
	}
}
