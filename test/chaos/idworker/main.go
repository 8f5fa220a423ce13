// Command idworker is the chaos suite's purpose-built worker for the cases of a
// delivery's identity (test/chaos/identity_test.go): package worker with a topology
// given on the command line — consumer names, filters, start policy, key lifetime,
// attempts — over a stream of its own, and an effect that is one row of
// chaos_effects (no unique constraint) written in the inbox transaction. It also
// produces intents straight into the outbox.
//
//	idworker run --database-url URL --nats-url URL --roles relay,consumers \
//	    --consumer audit=id.orders.> [--consumer NAME=FILTER ...] [--start new] ...
//	idworker produce --database-url URL --key-prefix P --count N \
//	    --message id.orders.created --message id.orders.line:line-1 ...
//
// run arms the fault points and switches of IDEM_FAULTS (internal/faults): a test
// binary inside the module may; the shipped worker needs the idemfaults build tag.
// It prints "idworker: started" once the worker runs, and exits 1 with the worker's
// error when a component fails (a consumer refused another installation's
// durable, say, or its NATS connection closed for good: --nats-max-reconnects
// bounds the attempts). produce enqueues each intent in a transaction of its own, wakes
// the relays, and prints "produced KEY" after each commit.
//
// The tables chaos_effects and chaos_broken are the test's to create: a handler
// whose key is in chaos_broken fails (the bug a dead-letter replay comes after).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/wire"
	"github.com/idemkit/idem/worker"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: idworker run|produce [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "run":
		err = run(os.Args[2:])
	case "produce":
		err = produce(os.Args[2:])
	default:
		err = fmt.Errorf("unknown subcommand %q (want run or produce)", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "idworker:", err)
		os.Exit(1)
	}
}

// multi is a repeatable string flag.
type multi []string

func (m *multi) String() string     { return strings.Join(*m, " ") }
func (m *multi) Set(v string) error { *m = append(*m, v); return nil }

// common are the flags both subcommands take.
type common struct {
	databaseURL, stream, subjects string
}

func (c *common) register(fs *flag.FlagSet) {
	fs.StringVar(&c.databaseURL, "database-url", "", "Postgres URL (required)")
	fs.StringVar(&c.stream, "stream", "CHAOSID", "the stream")
	fs.StringVar(&c.subjects, "subjects", "id.>", "the stream's subjects, comma-separated")
}

func (c *common) pool(ctx context.Context, conns int32) (*pgxpool.Pool, error) {
	if c.databaseURL == "" {
		return nil, errors.New("--database-url is required")
	}
	cfg, err := pgxpool.ParseConfig(c.databaseURL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = conns
	cfg.ConnConfig.RuntimeParams["application_name"] = "idem-idworker"
	return pgxpool.NewWithConfig(ctx, cfg)
}

func run(args []string) error {
	fs := flag.NewFlagSet("idworker run", flag.ContinueOnError)
	var c common
	c.register(fs)
	var consumers multi
	natsURL := fs.String("nats-url", "", "NATS URL (required)")
	roles := fs.String("roles", "relay,consumers", "relay (with its reconciler) and/or consumers")
	fs.Var(&consumers, "consumer", "NAME=FILTER: a consumer to run (repeatable)")
	start := fs.String("start", "", "where this process's consumers start when new to the installation: backfill or new (default: backfill, refusing a likely rename)")
	keyLifetime := fs.Duration("key-lifetime", 0, "the consumers' inbox key lifetime (0: the default)")
	maxAge := fs.Duration("max-age", 0, "the stream's MaxAge when this worker creates it (0: the default)")
	ackWait := fs.Duration("ack-wait", 2*time.Second, "the consumers' AckWait")
	maxDeliver := fs.Int("max-deliver", 0, "the consumers' MaxDeliver (0: the default)")
	backoff := fs.Duration("backoff", 0, "a fixed redelivery delay after a failed attempt (0: the default backoff)")
	reconcileAfter := fs.String("reconcile-after", "1s", "the reconciler's After (off: no reconciler)")
	maxReconnects := fs.Int("nats-max-reconnects", -1, "the NATS connection's reconnect attempts before it closes for good (-1: without limit)")
	reconnectWait := fs.Duration("nats-reconnect-wait", 100*time.Millisecond, "the pause between the NATS connection's reconnect attempts")
	relayMode := fs.String("relay", "", "the relay: log, poll, or empty for log where it can run")
	external := fs.Duration("external", 0, "run the consumers' effects as external effects that take this long and finish even when cancelled (0: in the inbox transaction)")
	leaseFor := fs.Duration("lease-for", 0, "an external effect's lease (0: the default)")
	shutdownTimeout := fs.Duration("shutdown-timeout", 5*time.Second, "how long Stop lets the work in flight finish before it cancels it (the hard stop)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	fset, err := faults.Parse(os.Getenv(faults.EnvVar))
	if err != nil {
		return err
	}
	if fset != nil {
		log.Warn("FAULT INJECTION: this worker arms fault points", "spec", os.Getenv(faults.EnvVar))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	pool, err := c.pool(ctx, 8)
	if err != nil {
		return err
	}
	defer pool.Close()
	nc, err := nats.Connect(*natsURL, nats.Name("idem-idworker"), nats.MaxReconnects(*maxReconnects), nats.ReconnectWait(*reconnectWait))
	if err != nil {
		return fmt.Errorf("nats: %w", err)
	}
	defer nc.Close()

	inst, err := install.New(pool, nc, install.Config{
		Stream: install.Stream{Name: c.stream, Subjects: strings.Split(c.subjects, ","), MaxAge: *maxAge},
		Logger: log, Observer: observe(log),
	})
	if err != nil {
		return err
	}
	cfg := worker.Config{
		Relay:            worker.RelayConfig{Mode: *relayMode},
		DisableRelay:     !strings.Contains(*roles, "relay"),
		DisableRetention: true, // the tests forget keys with SQL, as the collector would
	}
	if *reconcileAfter == "off" {
		cfg.DisableReconciler = true
	} else {
		after, err := time.ParseDuration(*reconcileAfter)
		if err != nil {
			return fmt.Errorf("--reconcile-after: %w", err)
		}
		cfg.Reconcile = worker.ReconcileConfig{After: after} // a pass every After
	}
	if strings.Contains(*roles, "consumers") {
		for _, spec := range consumers {
			name, filter, ok := strings.Cut(spec, "=")
			if !ok {
				return fmt.Errorf("--consumer %q: want NAME=FILTER", spec)
			}
			cc := consumer.Config{Name: name, Subject: filter, Handler: effect(name),
				KeyLifetime: *keyLifetime, AckWait: *ackWait, MaxDeliver: *maxDeliver, CheckInterval: time.Second}
			if *external > 0 {
				cc.Handler, cc.External, cc.LeaseFor = nil, externalEffect(name, pool, *external, log), *leaseFor
			}
			switch *start {
			case "":
			case "backfill":
				cc.Start = consumer.StartBackfill
			case "new":
				cc.Start = consumer.StartNew
			default:
				return fmt.Errorf("--start %q: want backfill or new", *start)
			}
			if *backoff > 0 {
				d := *backoff
				cc.Backoff = func(int) time.Duration { return d }
			}
			cfg.Consumers = append(cfg.Consumers, cc)
		}
	}
	w, err := worker.New(inst, cfg)
	if err != nil {
		return err
	}
	if err := w.Start(faults.With(ctx, fset)); err != nil {
		return err
	}
	log.Info("idworker: started", "roles", *roles, "consumers", len(cfg.Consumers))
	select {
	case <-ctx.Done():
	case <-w.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), *shutdownTimeout)
	defer cancel()
	return w.Stop(sctx)
}

// externalEffect is an external consumer's handler: an effect in another system
// (here a row of chaos_effects written outside the inbox, on a connection of its
// own) that takes took and, like an SMTP DATA already sent, completes even when
// its context is cancelled on the way.
func externalEffect(name string, pool *pgxpool.Pool, took time.Duration, log *slog.Logger) consumer.ExternalHandler {
	return consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
		log.Info("idworker: external effect started", "consumer", name, "key", e.Key)
		time.Sleep(took)
		_, err := pool.Exec(context.WithoutCancel(ctx), `INSERT INTO chaos_effects (consumer, key, message, payload) VALUES ($1, $2, $3, $4)`,
			name, e.Key, wire.MessageOf(e.Subject, e.Name), e.Payload)
		if err != nil {
			return nil, err
		}
		log.Info("idworker: external effect performed", "consumer", name, "key", e.Key, "cancelled", ctx.Err() != nil)
		return []byte(`{"performed":true}`), nil
	})
}

// effect is the consumer's handler: one row of chaos_effects per delivery it runs,
// in the inbox transaction; it fails while the key is in chaos_broken.
func effect(name string) consumer.Handler {
	return consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		var broken bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM chaos_broken WHERE key = $1)`, d.Key).Scan(&broken); err != nil {
			return nil, err
		}
		if broken {
			return nil, errors.New("idworker: the handler's bug: this key is in chaos_broken")
		}
		_, err := tx.Exec(ctx, `INSERT INTO chaos_effects (consumer, key, message, payload) VALUES ($1, $2, $3, $4)`,
			name, d.Key, wire.MessageOf(d.Subject, d.Name), d.Payload)
		return nil, err
	})
}

// observe logs what the consumers and the reconciler did beyond processing, for
// the test's counts: folded duplicates, copies skipped as meant for other
// consumers, dead letters, re-drives, alerts.
func observe(log *slog.Logger) idem.Observer {
	return func(e idem.Event) {
		switch e.Outcome {
		case idem.OutcomeDuplicate, idem.OutcomeSkipped, idem.OutcomeDeadLettered,
			idem.OutcomeRedriven, idem.OutcomeAlerted:
			log.Info("idworker: event", "component", e.Component, "name", e.Name, "outcome", e.Outcome, "count", e.Count)
		}
	}
}

func produce(args []string) error {
	fs := flag.NewFlagSet("idworker produce", flag.ContinueOnError)
	var c common
	c.register(fs)
	var messages multi
	prefix := fs.String("key-prefix", "", "keys are PREFIX-0, PREFIX-1, ... (required)")
	from := fs.Int("from", 0, "the first key's number")
	count := fs.Int("count", 1, "intents to produce")
	pace := fs.Duration("pace", 0, "pause between intents")
	fs.Var(&messages, "message", "SUBJECT or SUBJECT:NAME: one message of every intent (repeatable)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *prefix == "" || len(messages) == 0 {
		return errors.New("produce: --key-prefix and at least one --message are required")
	}
	ctx := context.Background()
	pool, err := c.pool(ctx, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	// No broker: the producer only writes the outbox, and wakes the relays by NOTIFY.
	inst, err := install.New(pool, nil, install.Config{Stream: install.Stream{Name: c.stream, Subjects: strings.Split(c.subjects, ",")}})
	if err != nil {
		return err
	}
	ob := outbox.New(inst)
	for i := *from; i < *from+*count; i++ {
		key := fmt.Sprintf("%s-%d", *prefix, i)
		var msgs []idem.Message
		for _, m := range messages {
			subject, name, _ := strings.Cut(m, ":")
			msgs = append(msgs, idem.Message{Key: key, Subject: subject, Name: name,
				Payload: fmt.Appendf(nil, `{"key":%q,"message":%q}`, key, wire.MessageOf(subject, name))})
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.Enqueue(ctx, tx, msgs...) }); err != nil {
			return fmt.Errorf("produce %s: %w", key, err)
		}
		fmt.Printf("produced %s\n", key)
		if err := ob.Wake(ctx); err != nil {
			fmt.Fprintln(os.Stderr, "idworker: produce:", err) // the relays' poll finds the rows
		}
		if *pace > 0 {
			time.Sleep(*pace) // the producer's pace, not a wait for some state
		}
	}
	return nil
}
