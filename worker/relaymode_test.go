package worker_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/producer"
	"github.com/idemkit/idem/worker"
)

// pollPass reports the suite's polling pass (IDEM_TEST_RELAY=poll), whose test
// role may not replicate.
func pollPass() bool { return os.Getenv("IDEM_TEST_RELAY") == "poll" }

// The worker says once, at start, which relay it runs and why: the log relay
// where the server and the role allow it, the polling relay elsewhere, naming
// what is missing.
func TestWorkerSaysWhichRelayItRuns(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	var l logs
	icfg := install.Config{Stream: install.Stream{Name: testenv.Stream, Subjects: []string{testenv.Subjects}}, Logger: l.logger()}
	if _, err := tryStart(t, env, icfg, worker.Config{DisableRetention: true}); err != nil {
		t.Fatal(err)
	}
	line := "relay: log relay (reads committed outbox rows from a logical replication slot): wal_level is logical and the role may replicate"
	if pollPass() {
		line = "relay: polling relay (SELECT ... FOR UPDATE SKIP LOCKED): the database role may not replicate"
	}
	if n := l.count(line); n != 1 {
		t.Errorf("the start log says %d times %q, want once:\n%s", n, line, l.String())
	}
}

// Relay.Mode "log" refuses to start where the log relay cannot run, saying why;
// "poll" runs the polling relay where the log relay could.
func TestRelayModeLogRefusesWhereItCannotRun(t *testing.T) {
	t.Parallel()
	if !pollPass() {
		t.Skip("the test role may replicate: the log relay can run (IDEM_TEST_RELAY=poll runs this)")
	}
	env := testenv.New(t)
	icfg := install.Config{Stream: install.Stream{Name: testenv.Stream, Subjects: []string{testenv.Subjects}}}
	_, err := tryStart(t, env, icfg, worker.Config{Relay: worker.RelayConfig{Mode: "log"}, DisableRetention: true})
	if err == nil || !strings.Contains(err.Error(), `Relay.Mode is "log", but the database role may not replicate`) {
		t.Fatalf("Start = %v; want a refusal naming the role", err)
	}
}

// A worker started with the polling relay after the log relay ran takes over the
// rows the log relay never published, publishes them, and drops the slot no
// relay reads any more.
func TestPollingRelayTakesOverFromTheLogRelay(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	env.RequireLogRelay(t)
	icfg := install.Config{Stream: install.Stream{Name: testenv.Stream, Subjects: []string{testenv.Subjects}}}
	first, err := tryStart(t, env, icfg, worker.Config{DisableRetention: true, DisableReconciler: true})
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 20*time.Second, "the log relay streams its slot", func() bool {
		return env.DB.Count(t, `SELECT count(*) FROM pg_stat_replication r JOIN pg_replication_slots s ON s.active_pid = r.pid
			WHERE s.database = current_database() AND r.state = 'streaming'`) == 1
	})
	ctx := context.Background()
	if err := first.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	// Written while no relay runs: the log relay's rows, in its slot.
	ob := outbox.New(env.Inst)
	err = pgx.BeginFunc(ctx, env.DB.Pool, func(tx pgx.Tx) error {
		return ob.Enqueue(ctx, tx, idem.Message{Key: "k-1", Subject: testenv.Subject, Payload: []byte(`{}`)},
			idem.Message{Key: "k-2", Subject: testenv.Subject, Payload: []byte(`{}`)})
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE relay = 'log'`); n != 2 {
		t.Fatalf("log relay rows = %d, want 2", n)
	}
	if _, err := tryStart(t, env, icfg, worker.Config{Relay: worker.RelayConfig{Mode: "poll"}, DisableRetention: true, DisableReconciler: true}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 20*time.Second, "both published by the polling relay", func() bool {
		return env.DB.Count(t, `SELECT count(*) FROM idem_outbox WHERE relay IS NULL AND published_at IS NOT NULL`) == 2
	})
	if n := env.StreamMsgs(t, testenv.Stream); n != 2 {
		t.Errorf("stream holds %d messages, want 2", n)
	}
	if n := env.DB.Count(t, `SELECT count(*) FROM pg_replication_slots WHERE database = current_database()`); n != 0 {
		t.Errorf("slots left: %d, want 0 (a slot no relay reads keeps WAL)", n)
	}
}

// A worker that runs the log relay without the ingress is unready while its slot
// holds more WAL than Relay.MaxSlotLag; one with the ingress stays ready and says
// so in /healthz.
func TestSlotLagFailsTheRelaysReadiness(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	env.RequireLogRelay(t)
	icfg := install.Config{Stream: install.Stream{Name: testenv.Stream, Subjects: []string{testenv.Subjects}}}
	relayOnly, err := tryStart(t, env, icfg, worker.Config{Relay: worker.RelayConfig{MaxSlotLag: 1}, DisableRetention: true})
	if err != nil {
		t.Fatal(err)
	}
	withIngress, err := tryStart(t, env, icfg, worker.Config{Relay: worker.RelayConfig{MaxSlotLag: 1}, Ingress: &producer.Config{}, DisableRetention: true})
	if err != nil {
		t.Fatal(err)
	}
	// WAL the slot has not confirmed yet: any write.
	lagging := func(w *worker.Worker) bool {
		env.DB.Count(t, `SELECT count(*) FROM (SELECT pg_logical_emit_message(false, 'test', 'x')) AS w`)
		for _, p := range w.Ready(context.Background()) {
			if strings.Contains(p, "more than Relay.MaxSlotLag 1") {
				return true
			}
		}
		return false
	}
	testenv.Eventually(t, 20*time.Second, "the relay-only worker unready for its slot's lag", func() bool { return lagging(relayOnly) })
	if lagging(withIngress) {
		t.Error("the worker with the ingress is unready for the slot's lag")
	}
	rec := httptest.NewRecorder()
	withIngress.LiveHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
	if !strings.Contains(rec.Body.String(), "more than Relay.MaxSlotLag 1") {
		t.Errorf("/healthz of the ingress worker does not name the slot's lag:\n%s", rec.Body.String())
	}
}
