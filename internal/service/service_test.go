package service_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/internal/service"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/producer"
)

type bundle struct {
	db      *pgtest.DB
	dataDir string
	svc     *service.Service
}

func setup(t *testing.T) *bundle {
	t.Helper()
	t.Parallel()
	return &bundle{db: pgtest.New(t), dataDir: t.TempDir()}
}

func (b *bundle) config() service.Config {
	return service.Config{
		DatabaseURL:    b.db.URL,
		DataDir:        b.dataDir,
		HTTPAddr:       "127.0.0.1:0",
		ChargeConsumer: consumer.Config{AckWait: 2 * time.Second},
	}
}

func (b *bundle) start(t *testing.T, cfg service.Config) *service.Service {
	t.Helper()
	svc, err := service.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = svc.Shutdown(ctx)
	})
	b.svc = svc
	return svc
}

func (b *bundle) client(t *testing.T) *producer.Client {
	t.Helper()
	j, err := producer.Open(filepath.Join(t.TempDir(), "journal"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { j.Close() })
	c, err := producer.NewClient(producer.ClientConfig{
		Journal: j, BaseURL: "http://" + b.svc.HTTPAddr(),
		BackoffBase: time.Millisecond, BackoffMax: 10 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// settled waits until every key has been consumed (its inbox row committed with the
// ledger row it guards), so that counting ledger rows afterwards is final.
func (b *bundle) settled(t *testing.T, keys ...idem.Key) {
	t.Helper()
	for _, k := range keys {
		testenv.Eventually(t, 45*time.Second, "key "+string(k)+" consumed", func() bool {
			return b.db.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'charges' AND key = $1`, string(k)) == 1
		})
	}
}

// The README's check, automated: the first response is dropped, the client retries
// with the same key, the server replays, and exactly one ledger row lands.
func TestDroppedResponseLandsOneLedgerRow(t *testing.T) {
	b := setup(t)
	b.start(t, b.config())
	res, err := b.client(t).Submit(context.Background(), producer.Request{
		Path: "/v1/payments", Body: []byte(`{"account":"acct_drop","amount_cents":1250}`), DropFirstResponse: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != producer.IntentDone || res.Attempts != 2 || !res.Replayed {
		t.Fatalf("result = %+v, want done after 2 attempts with a replayed answer", res)
	}
	b.settled(t, res.Key)
	if n := b.db.Count(t, `SELECT count(*) FROM ledger_entries WHERE account = 'acct_drop'`); n != 1 {
		t.Fatalf("ledger rows = %d, want 1", n)
	}
	if n := b.db.Count(t, `SELECT count(*) FROM payments WHERE account = 'acct_drop'`); n != 1 {
		t.Fatalf("payments rows = %d, want 1", n)
	}
}

// The negative control: the journaled key is wiped before the retry, so a new key
// is minted and the one intent becomes two charges. If this ever lands one row, the
// test above proves nothing.
func TestForgottenKeyLandsTwoLedgerRows(t *testing.T) {
	b := setup(t)
	b.start(t, b.config())
	res, err := b.client(t).Submit(context.Background(), producer.Request{
		Path: "/v1/payments", Body: []byte(`{"account":"acct_forget","amount_cents":1250}`), ForgetKey: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.ForgottenKey == "" || res.ForgottenKey == res.Key {
		t.Fatalf("result = %+v, want a second, freshly minted key", res)
	}
	b.settled(t, res.Key, res.ForgottenKey)
	if n := b.db.Count(t, `SELECT count(*) FROM ledger_entries WHERE account = 'acct_forget'`); n != 2 {
		t.Fatalf("ledger rows = %d, want 2 (the forgotten key is a second intent)", n)
	}
}

// Graceful shutdown under load loses nothing: a worker shut down mid-stream
// finishes its batches; a new worker on the same database and JetStream store
// processes the rest; every key lands exactly once.
func TestGracefulShutdownUnderLoadLosesNothing(t *testing.T) {
	b := setup(t)
	const n = 3000
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, b.db.Pool, func(tx pgx.Tx) error {
		msgs := make([]idem.Message, n)
		for i := range msgs {
			msgs[i] = idem.Message{Key: fmt.Sprintf("shut-%05d", i), Subject: idem.SubjectCharge, Payload: testenv.ChargePayload("acct_shut", i+1)}
		}
		return outbox.EnqueueBatch(ctx, tx, msgs)
	})
	if err != nil {
		t.Fatal(err)
	}
	cfg := b.config()
	cfg.ChargeConsumer.BatchSize = 20
	first, err := service.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "some charges processed", func() bool {
		return b.db.Count(t, `SELECT count(*) FROM ledger_entries`) > 0
	})
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := first.Shutdown(sctx); err != nil {
		t.Fatalf("graceful shutdown: %v", err)
	}
	midway := b.db.Count(t, `SELECT count(*) FROM ledger_entries`)
	t.Logf("ledger rows when the first worker stopped: %d of %d", midway, n)

	b.start(t, b.config()) // same database, same JetStream store
	testenv.Eventually(t, 60*time.Second, "all charges processed", func() bool {
		return b.db.Count(t, `SELECT count(*) FROM idem_inbox WHERE consumer = 'charges'`) == n
	})
	if got := b.db.Count(t, `SELECT count(*) FROM ledger_entries`); got != n {
		t.Fatalf("ledger rows = %d, want %d", got, n)
	}
	if got := b.db.Count(t, `SELECT count(DISTINCT idempotency_key) FROM ledger_entries`); got != n {
		t.Fatalf("distinct keys = %d, want %d", got, n)
	}
}

// The worker refuses to start when the inbox would forget keys the stream can still
// redeliver, and says which numbers are wrong.
func TestRefusesToStartWithBadLifetimes(t *testing.T) {
	b := setup(t)
	cfg := b.config()
	cfg.Stream.MaxAge = 7 * 24 * time.Hour
	cfg.ChargeConsumer.KeyLifetime = 48 * time.Hour
	_, err := service.Start(context.Background(), cfg)
	if err == nil {
		t.Fatal("started with an inbox lifetime shorter than the stream's MaxAge")
	}
	for _, want := range []string{"refusing to start", "inbox key lifetime 48h0m0s", "MaxAge 168h0m0s"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}
