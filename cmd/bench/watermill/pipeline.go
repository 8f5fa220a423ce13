package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The application's topology, the way the Watermill docs ("Forwarder (the outbox
// pattern)") lay it out:
//
//	POST /v1/payments --(one Postgres tx: payments row + enveloped message)--> watermill_payments_outbox
//	forwarder (watermill-sql Subscriber) --(watermill-nats Publisher)--> JetStream stream payments_charged
//	router (watermill-nats Subscriber, durable "ledger") -> Deduplicator -> ledger_entries row
const (
	// forwarderTopic is the watermill-sql topic the forwarder listens on (its
	// messages live in the table "watermill_payments_outbox").
	forwarderTopic = "payments_outbox"
	// chargeTopic is the destination topic: a JetStream stream and its subject.
	chargeTopic = "payments_charged"
	// durable names the router's durable JetStream consumer (and its queue group).
	durable = "ledger"
	// headerKey is the HTTP header, and the message metadata field, that carries
	// the idempotency key.
	headerKey = "Idempotency-Key"
)

// pipelineConfig configures the Watermill application.
type pipelineConfig struct {
	// subscribers is watermill-nats' SubscriberConfig.SubscribersCount (its
	// default, 1, unless -subscribers says otherwise).
	subscribers int
	// pollInterval is watermill-sql's SubscriberConfig.PollInterval for the
	// forwarder (0: its default, 1s).
	pollInterval time.Duration
	log          *slog.Logger
}

// pipeline is the running application: the HTTP ingress, the forwarder and the
// ledger router. It records when each key's ledger row committed.
type pipeline struct {
	pool     *pgxpool.Pool
	wmLogger watermill.LoggerAdapter
	url      string

	srv     *http.Server
	fwd     *forwarder.Forwarder
	natsPub *wmnats.Publisher
	router  *message.Router
	runErrs chan error
	// nc watches the durable consumer (drained); the application does not use it.
	nc *nats.Conn

	// committed[i] is when key i's ledger row committed, as a duration since base
	// (0: not yet); effects counts the non-zero ones.
	index     map[string]int
	committed []atomic.Int64
	effects   atomic.Int64
	base      time.Time
}

// charge is the body of POST /v1/payments, and the message payload.
type charge struct {
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
}

func decodeCharge(b []byte) (charge, error) {
	var c charge
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return c, err
	}
	if strings.TrimSpace(c.Account) == "" || c.AmountCents <= 0 {
		return c, errors.New("account is required and amount_cents must be positive")
	}
	return c, nil
}

// startPipeline starts the router, then the forwarder, then the HTTP server, and
// returns once all three are running. index maps every key the phase will send
// to its position; base is the clock the client's send times are taken on.
func startPipeline(ctx context.Context, e *env, index map[string]int, base time.Time, cfg pipelineConfig) (p *pipeline, err error) {
	p = &pipeline{
		pool:      e.pool,
		wmLogger:  watermill.NewSlogLogger(cfg.log),
		index:     index,
		committed: make([]atomic.Int64, len(index)),
		base:      base,
		runErrs:   make(chan error, 2),
	}
	defer func() {
		if err != nil {
			_ = p.stop(context.WithoutCancel(ctx))
		}
	}()

	// 1. The consumer side: a Router whose one handler reads the stream through a
	// durable JetStream consumer and writes the ledger row, behind the
	// Deduplicator. It starts first so that the stream exists (AutoProvision)
	// before the forwarder publishes to it.
	//
	// JetStream as the watermill-nats docs ask for exactly-once: AckAsync false
	// (the subscriber acks with AckSync once the handler returned) and, on the
	// publisher, TrackMsgId.
	sub, err := wmnats.NewSubscriber(wmnats.SubscriberConfig{
		URL:              e.natsURL(),
		QueueGroupPrefix: durable,
		SubscribersCount: cfg.subscribers,
		JetStream: wmnats.JetStreamConfig{
			AutoProvision:    true,
			DurablePrefix:    durable,
			AckAsync:         false,
			SubscribeOptions: []nats.SubOpt{nats.DeliverAll(), nats.AckExplicit()},
		},
	}, p.wmLogger)
	if err != nil {
		return p, fmt.Errorf("watermill-nats subscriber: %w", err)
	}
	if p.router, err = message.NewRouter(message.RouterConfig{}, p.wmLogger); err != nil {
		return p, fmt.Errorf("router: %w", err)
	}
	// The Deduplicator as Watermill ships it, keyed on the idempotency key instead
	// of its default (an Adler-32 hash of the payload, which would fold two
	// different requests with the same body). Its Repository is left nil: the
	// default, NewMapExpiringKeyRepository with a one-minute window, in process
	// memory. Watermill ships no other ExpiringKeyRepository.
	dedup := &middleware.Deduplicator{KeyFactory: middleware.NewMessageHasherFromMetadataField(headerKey)}
	p.router.AddConsumerHandler("ledger", chargeTopic, sub, p.writeLedger).AddMiddleware(dedup.Middleware)
	if err := p.run("router", p.router.Run, p.router.Running()); err != nil {
		return p, err
	}

	// 2. The forwarder: a watermill-sql Subscriber on the forwarder topic (the
	// Postgres schema and offsets adapters, which create their tables on
	// Subscribe, and the subscriber's default polling), and a watermill-nats
	// Publisher to JetStream.
	sqlSub, err := wmsql.NewSubscriber(wmsql.BeginnerFromPgx(e.pool), wmsql.SubscriberConfig{
		SchemaAdapter:    wmsql.DefaultPostgreSQLSchema{},
		OffsetsAdapter:   wmsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
		PollInterval:     cfg.pollInterval,
	}, p.wmLogger)
	if err != nil {
		return p, fmt.Errorf("watermill-sql subscriber: %w", err)
	}
	// AutoProvision is left off on the publisher: on, it asks the broker for the
	// stream's info before every publish; the router's subscriber created the stream.
	p.natsPub, err = wmnats.NewPublisher(wmnats.PublisherConfig{
		URL:       e.natsURL(),
		JetStream: wmnats.JetStreamConfig{TrackMsgId: true},
	}, p.wmLogger)
	if err != nil {
		return p, fmt.Errorf("watermill-nats publisher: %w", err)
	}
	p.fwd, err = forwarder.NewForwarder(sqlSub, p.natsPub, p.wmLogger, forwarder.Config{ForwarderTopic: forwarderTopic})
	if err != nil {
		return p, fmt.Errorf("forwarder: %w", err)
	}
	if err := p.run("forwarder", p.fwd.Run, p.fwd.Running()); err != nil {
		return p, err
	}

	// 3. The HTTP ingress.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return p, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/payments", p.payment)
	p.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	p.url = "http://" + ln.Addr().String() + "/v1/payments"
	go func() {
		if err := p.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintf(os.Stderr, "watermill-http: HTTP server: %v\n", err)
		}
	}()

	// A plain client connection, only to watch the durable consumer drain.
	if p.nc, err = nats.Connect(e.natsURL(), nats.Name("bench-wm-watch")); err != nil {
		return p, fmt.Errorf("connect to NATS: %w", err)
	}
	return p, nil
}

// run starts a Watermill Run loop in the background and waits until it reports
// running (or fails first).
func (p *pipeline) run(what string, run func(context.Context) error, running <-chan struct{}) error {
	errs := make(chan error, 1)
	go func() {
		err := run(context.Background()) // stopped by Close
		errs <- err
		if err != nil {
			p.runErrs <- fmt.Errorf("%s: %w", what, err)
		}
	}()
	select {
	case <-running:
		return nil
	case err := <-errs:
		return fmt.Errorf("%s stopped before it ran: %v", what, err)
	case <-time.After(30 * time.Second):
		return fmt.Errorf("%s not running after 30s", what)
	}
}

// payment is POST /v1/payments: the payments row and the message in one
// transaction, the message published through the forwarder's publisher wrapping
// a watermill-sql publisher bound to that transaction (one per transaction, as
// the watermill-sql docs prescribe).
func (p *pipeline) payment(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get(headerKey)
	if key == "" || len(key) > 36 { // the message UUID column is VARCHAR(36)
		http.Error(w, "Idempotency-Key header (at most 36 characters) is required", http.StatusBadRequest)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		http.Error(w, "reading body: "+err.Error(), http.StatusBadRequest)
		return
	}
	c, err := decodeCharge(body)
	if err != nil {
		http.Error(w, "invalid charge: "+err.Error(), http.StatusBadRequest)
		return
	}
	ctx := r.Context()
	err = pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO payments (idempotency_key, account, amount_cents) VALUES ($1, $2, $3)`,
			key, c.Account, c.AmountCents); err != nil {
			return fmt.Errorf("insert payment: %w", err)
		}
		// AutoInitializeSchema must stay off with a transaction (watermill-sql
		// refuses it): the forwarder's subscriber created the table.
		sqlPub, err := wmsql.NewPublisher(wmsql.TxFromPgx(tx), wmsql.PublisherConfig{
			SchemaAdapter: wmsql.DefaultPostgreSQLSchema{},
		}, p.wmLogger)
		if err != nil {
			return err
		}
		pub := forwarder.NewPublisher(sqlPub, forwarder.PublisherConfig{ForwarderTopic: forwarderTopic})
		// One message per request; its UUID is the idempotency key (so TrackMsgId
		// makes it the Nats-Msg-Id), and the key rides in the metadata for the
		// Deduplicator. The payload is the request body.
		msg := message.NewMessage(key, body)
		msg.Metadata.Set(headerKey, key)
		msg.SetContext(ctx) // the publisher runs its INSERT with the message's context
		if err := pub.Publish(chargeTopic, msg); err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		return nil
	})
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusAccepted)
	_ = json.NewEncoder(w).Encode(map[string]string{"key": key, "status": "accepted"})
}

// writeLedger is the router's handler: one autocommit INSERT of the ledger row.
// It runs behind the Deduplicator, which has already recorded the key as seen.
func (p *pipeline) writeLedger(msg *message.Message) error {
	key := msg.Metadata.Get(headerKey)
	c, err := decodeCharge(msg.Payload)
	if err != nil {
		return fmt.Errorf("message %s: %w", msg.UUID, err)
	}
	if _, err := p.pool.Exec(msg.Context(), `INSERT INTO ledger_entries (idempotency_key, account, amount_cents) VALUES ($1, $2, $3)`,
		key, c.Account, c.AmountCents); err != nil {
		return fmt.Errorf("insert ledger entry: %w", err)
	}
	// The INSERT returned: the row is committed. Record the first commit per key
	// on the client's monotonic clock.
	if i, ok := p.index[key]; ok && p.committed[i].CompareAndSwap(0, int64(time.Since(p.base))) {
		p.effects.Add(1)
	}
	return nil
}

// effectAt returns when key i's ledger row committed (zero time: not yet).
func (p *pipeline) effectAt(i int) time.Time {
	d := p.committed[i].Load()
	if d == 0 {
		return time.Time{}
	}
	return p.base.Add(time.Duration(d))
}

// failed returns the first error of a Run loop that stopped on its own.
func (p *pipeline) failed() error {
	select {
	case err := <-p.runErrs:
		return err
	default:
		return nil
	}
}

// waitDrained waits until the durable consumer has nothing pending or unacked,
// so that a late redelivery would be in the ledger before it is counted.
func (p *pipeline) waitDrained(ctx context.Context, timeout time.Duration) error {
	js, err := jetstream.New(p.nc)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	for {
		c, err := js.PushConsumer(ctx, chargeTopic, durable) // watermill-nats pkg/nats makes a push consumer
		if err != nil {
			return fmt.Errorf("consumer %s: %w", durable, err)
		}
		info, err := c.Info(ctx)
		if err != nil {
			return fmt.Errorf("consumer %s info: %w", durable, err)
		}
		if info.NumPending == 0 && info.NumAckPending == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("consumer %s not drained after %s: %d pending, %d unacked", durable, timeout, info.NumPending, info.NumAckPending)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// stop shuts the application down in order: no more requests, then the forwarder
// (and its SQL subscriber), then the router (and its JetStream subscriber).
func (p *pipeline) stop(ctx context.Context) error {
	var errs []error
	if p.srv != nil {
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		errs = append(errs, p.srv.Shutdown(sctx))
		cancel()
	}
	if p.fwd != nil {
		errs = append(errs, p.fwd.Close())
	}
	if p.natsPub != nil {
		errs = append(errs, p.natsPub.Close()) // the forwarder's router does not close its publisher
	}
	if p.router != nil {
		errs = append(errs, p.router.Close())
	}
	if p.nc != nil {
		p.nc.Close()
	}
	return errors.Join(errs...)
}
