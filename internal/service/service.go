// Package service assembles the idem worker: migrations, the HTTP ingress, the
// outbox relay and the consumers, over one Postgres pool and one JetStream
// connection (an embedded server when no NATS URL is given). cmd/worker is a thin
// flag parser over it; tests, the chaos suite and the benchmark start it in-process.
package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/internal/demo"
	"github.com/idemkit/idem/internal/embeddednats"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/metrics"
	"github.com/idemkit/idem/internal/pgembed"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/producer"
)

// DefaultDatabaseURL is used when Config.DatabaseURL is empty.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// Config configures the worker. The zero value runs everything with defaults and an
// embedded JetStream server under ./idem-data.
type Config struct {
	// DatabaseURL (default DefaultDatabaseURL).
	DatabaseURL string
	// PrivatePostgres: when no Postgres answers at DatabaseURL, start a private
	// cluster from the machine's PostgreSQL binaries under DataDir/postgres and use
	// it instead (the zero-setup start; cmd/worker sets it when DATABASE_URL was not
	// given).
	PrivatePostgres bool
	// NATSURL: empty starts an embedded JetStream server with its store under
	// DataDir/jetstream.
	NATSURL string
	// DataDir holds the embedded server's store (default ./idem-data).
	DataDir string
	// EmbeddedNATSPort: the embedded server's port (default: a free port).
	EmbeddedNATSPort int
	// HTTPAddr is the ingress address (default 127.0.0.1:8080; ":0" picks a port).
	HTTPAddr string
	// SMTPAddr is where the email consumer sends mail; empty leaves emails queued
	// in the stream (no email consumer runs).
	SMTPAddr string
	// ClientResendHorizon is how long clients keep re-sending a pending intent
	// (producer.Client's KeyLifetime; default 24h). It enters the lifetime invariant.
	ClientResendHorizon time.Duration

	// Components to run; all on unless disabled (several workers may split roles).
	DisableIngress, DisableRelay, DisableConsumers bool

	// ChargeConsumer tunes the idem.payments.charge consumer; Name, Subject and
	// handler are filled in.
	ChargeConsumer consumer.Config
	// EmailConsumer tunes the idem.emails.send consumer (when SMTPAddr is set);
	// Name, Subject, Handler, Logger and OnOutcome are filled in.
	EmailConsumer consumer.ExternalConfig
	// Relay tunes the outbox relay.
	Relay outbox.RelayConfig
	// Stream is used when the stream IDEM has to be created.
	Stream outbox.StreamConfig
	// Ingress tunes the HTTP idempotency middleware.
	Ingress producer.MiddlewareConfig

	// Collector tunes retention of expired keys and published outbox rows.
	Collector dedupe.CollectorConfig
	// DisableCollector turns retention off (several workers need only one).
	DisableCollector bool

	// TracerProvider records spans for the ingress and the consumers (default: no
	// tracing; trace context is still carried through the outbox headers).
	TracerProvider trace.TracerProvider

	// Faults arms deterministic fault points (nil: none).
	Faults *faults.Set
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// NATSURLFile, under DataDir, holds the embedded JetStream server's URL while it runs.
const NATSURLFile = "nats.url"

// ChargeConsumerName is the durable consumer (and inbox consumer) of charges.
const ChargeConsumerName = "charges"

func (c Config) withDefaults() Config {
	if c.DatabaseURL == "" {
		c.DatabaseURL = DefaultDatabaseURL
	}
	if c.DataDir == "" {
		c.DataDir = "idem-data"
	}
	if c.HTTPAddr == "" {
		c.HTTPAddr = "127.0.0.1:8080"
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.TracerProvider == nil {
		c.TracerProvider = noop.NewTracerProvider()
	}
	if c.ClientResendHorizon == 0 {
		c.ClientResendHorizon = 24 * time.Hour
	}
	return c
}

// Service is a running worker.
type Service struct {
	cfg  Config
	log  *slog.Logger
	Pool *pgxpool.Pool
	NC   *nats.Conn
	JS   jetstream.JetStream
	nats *embeddednats.Server // nil with an external server
	// stopPostgres stops the private Postgres the worker started (nil: none).
	stopPostgres func(context.Context) error
	// Metrics is the worker's Prometheus registry, served on /metrics.
	Metrics *metrics.Metrics
	http    *http.Server
	ln      net.Listener
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	errs    chan error
}

// Start connects, migrates and starts every enabled component. Stop it with
// Shutdown.
func Start(ctx context.Context, cfg Config) (*Service, error) {
	cfg = cfg.withDefaults()
	s := &Service{cfg: cfg, log: cfg.Logger, errs: make(chan error, 8)}
	ok := false
	defer func() {
		if !ok {
			s.closeConns()
		}
	}()

	if err := s.connect(ctx); err != nil {
		return nil, err
	}
	s.Metrics = metrics.New(s.Pool, s.log)
	stream, err := outbox.EnsureStream(ctx, s.JS, cfg.Stream)
	if err != nil {
		return nil, err
	}
	if err := s.checkLifetimes(ctx, stream); err != nil {
		return nil, err
	}

	runCtx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	if !cfg.DisableConsumers {
		if err := s.startCharges(runCtx); err != nil {
			cancel()
			return nil, err
		}
	}
	if !cfg.DisableRelay {
		if err := s.startRelay(runCtx); err != nil {
			cancel()
			return nil, err
		}
	}
	if !cfg.DisableConsumers && cfg.SMTPAddr != "" {
		if err := s.startEmails(runCtx, cfg.SMTPAddr); err != nil {
			cancel()
			return nil, err
		}
	}
	if !cfg.DisableCollector {
		cc := cfg.Collector
		if cc.Logger == nil {
			cc.Logger = s.log
		}
		cc.OnDeleted = chain2(cc.OnDeleted, s.Metrics.CollectorDeleted)
		col := dedupe.NewCollector(s.Pool, cc)
		s.run("collector", func() error { return col.Run(runCtx) })
	}
	if err := s.startHTTP(); err != nil {
		cancel()
		return nil, err
	}
	ok = true
	return s, nil
}

// connect opens the pool (migrating the schema) and the JetStream connection.
func (s *Service) connect(ctx context.Context) error {
	if s.cfg.PrivatePostgres {
		// Zero-setup start: when nothing answers at the URL the user did not choose,
		// run a private cluster from the machine's PostgreSQL binaries.
		url, stop, err := pgembed.Fallback(ctx, s.cfg.DatabaseURL, pgembed.Config{
			Dir: filepath.Join(s.cfg.DataDir, pgembed.Subdir), Logger: s.log})
		if err != nil {
			return fmt.Errorf("service: no Postgres answers at %s, and no private one: %w", redact(s.cfg.DatabaseURL), err)
		}
		s.cfg.DatabaseURL, s.stopPostgres = url, stop
	}
	pcfg, err := pgxpool.ParseConfig(s.cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("service: DATABASE_URL: %w", err)
	}
	if _, ok := pcfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		// Lets an operator (or the chaos suite) find the worker's connections.
		pcfg.ConnConfig.RuntimeParams["application_name"] = "idem-worker"
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("service: open database pool: %w", err)
	}
	s.Pool = pool
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		return fmt.Errorf("service: no Postgres answers at %s: %w (start one, or use docker-compose.yml)", redact(s.cfg.DatabaseURL), err)
	}
	applied, err := migrations.Apply(ctx, pool)
	if err != nil {
		return err
	}
	if len(applied) > 0 {
		s.log.Info("schema migrated", "applied", applied)
	}

	url := s.cfg.NATSURL
	if url == "" {
		store := filepath.Join(s.cfg.DataDir, "jetstream")
		ns, err := embeddednats.Start(embeddednats.Config{StoreDir: store, Port: s.cfg.EmbeddedNATSPort, SyncAlways: true})
		if err != nil {
			return fmt.Errorf("service: embedded JetStream: %w", err)
		}
		s.nats = ns
		url = ns.URL()
		// Operator commands (dead-letters replay) find the embedded server here.
		if err := os.WriteFile(filepath.Join(s.cfg.DataDir, NATSURLFile), []byte(url+"\n"), 0o644); err != nil {
			return fmt.Errorf("service: record embedded NATS URL: %w", err)
		}
		s.log.Info("embedded JetStream started", "url", url, "store", store)
	}
	nc, err := nats.Connect(url, nats.Name("idem-worker"), nats.MaxReconnects(-1), nats.ReconnectWait(250*time.Millisecond))
	if err != nil {
		return fmt.Errorf("service: connect to NATS at %s: %w", url, err)
	}
	s.NC = nc
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("service: jetstream: %w", err)
	}
	s.JS = js
	return nil
}

// checkLifetimes refuses to start when a key could be forgotten while its intent
// can still arrive again. It reads the stream's real MaxAge: an operator may have
// changed it since the stream was created.
func (s *Service) checkLifetimes(ctx context.Context, stream jetstream.Stream) error {
	info, err := stream.Info(ctx)
	if err != nil {
		return fmt.Errorf("service: stream info: %w", err)
	}
	probe, err := consumer.New(s.Pool, s.JS, s.chargeConfig())
	if err != nil {
		return err
	}
	cc := probe.Config()
	requests := s.cfg.Ingress.KeyLifetime
	if requests == 0 {
		mw, err := producer.NewMiddleware(s.Pool, s.cfg.Ingress)
		if err != nil {
			return err
		}
		requests = mw.KeyLifetime()
	}
	l := dedupe.Lifetimes{
		InboxKey:     cc.KeyLifetime,
		RequestKey:   requests,
		StreamMaxAge: info.Config.MaxAge,
		Redelivery:   cc.RedeliveryHorizon(),
		ClientResend: s.cfg.ClientResendHorizon,
	}
	if s.cfg.SMTPAddr != "" {
		ec, err := s.emailConfig(s.cfg.SMTPAddr)
		if err != nil {
			return err
		}
		l.Redelivery = max(l.Redelivery, ec.RedeliveryHorizon())
	}
	if err := l.Check(); err != nil {
		return fmt.Errorf("service: refusing to start: %w", err)
	}
	s.log.Info("key lifetimes checked", "inbox", l.InboxKey, "requests", l.RequestKey, "stream_max_age", l.StreamMaxAge,
		"redelivery_horizon", l.Redelivery, "client_resend", l.ClientResend)
	return nil
}

func (s *Service) chargeConfig() consumer.Config {
	cc := s.cfg.ChargeConsumer
	cc.Name, cc.Subject = ChargeConsumerName, idem.SubjectCharge
	cc.Handler, cc.BatchHandler = nil, demo.ChargeHandler{}
	if cc.Logger == nil {
		cc.Logger = s.log
	}
	if cc.TracerProvider == nil {
		cc.TracerProvider = s.cfg.TracerProvider
	}
	if s.Metrics != nil {
		cc.OnOutcome = chain3(cc.OnOutcome, s.Metrics.ConsumerOutcome)
	}
	return cc
}

func (s *Service) startCharges(ctx context.Context) error {
	cc := s.chargeConfig()
	if s.cfg.Faults.Armed(faults.SkipInboxClaim) {
		s.log.Warn("NEGATIVE CONTROL: the charge consumer runs WITHOUT its inbox claim; effects will double")
		cc.UnsafeSkipInboxClaim = true
	}
	cc.BeforeCommit = withFault(s.cfg.Faults, faults.EffectBeforeCommit, cc.BeforeCommit)
	cc.AfterCommit = withFault(s.cfg.Faults, faults.ConsumerAfterCommit, cc.AfterCommit)
	c, err := consumer.New(s.Pool, s.JS, cc)
	if err != nil {
		return err
	}
	s.run("charges consumer", func() error { return c.Run(ctx) })
	return nil
}

func (s *Service) startRelay(ctx context.Context) error {
	rc := s.cfg.Relay
	if rc.Logger == nil {
		rc.Logger = s.log
	}
	rc.OnBatch = chain3(rc.OnBatch, s.Metrics.RelayBatch)
	rc.AfterPublish = withFault(s.cfg.Faults, faults.RelayAfterPublish, rc.AfterPublish)
	r, err := outbox.NewRelay(s.Pool, s.JS, rc)
	if err != nil {
		return err
	}
	s.run("relay", func() error { return r.Run(ctx) })
	return nil
}

func (s *Service) startHTTP() error {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("ok\n")) //nolint:errcheck
	})
	mux.HandleFunc("GET /readyz", s.readyz)
	mux.Handle("GET /metrics", s.Metrics.Handler())
	if !s.cfg.DisableIngress {
		icfg := s.cfg.Ingress
		if icfg.Logger == nil {
			icfg.Logger = s.log
		}
		if prev := icfg.OnOutcome; prev != nil {
			icfg.OnOutcome = func(o string) { prev(o); s.Metrics.IngressOutcome(o) }
		} else {
			icfg.OnOutcome = s.Metrics.IngressOutcome
		}
		if s.cfg.Faults.Armed(faults.IngressAfterCommit) {
			prev := icfg.AfterCommit
			icfg.AfterCommit = func(ctx context.Context, scope string, key idem.Key) {
				s.cfg.Faults.Hit(faults.IngressAfterCommit)
				if prev != nil {
					prev(ctx, scope, key)
				}
			}
		}
		ingress, err := demo.NewIngress(s.Pool, icfg)
		if err != nil {
			return err
		}
		mux.Handle("/v1/", traced(s.cfg.TracerProvider, ingress))
	}
	ln, err := net.Listen("tcp", s.cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("service: listen on %s: %w", s.cfg.HTTPAddr, err)
	}
	s.ln = ln
	s.http = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := s.http.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.errs <- fmt.Errorf("http: %w", err)
		}
	}()
	s.log.Info("http listening", "addr", ln.Addr().String())
	return nil
}

// readyz answers 200 only when Postgres and NATS both answer.
func (s *Service) readyz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	var problems []string
	if err := s.Pool.Ping(ctx); err != nil {
		problems = append(problems, "postgres: "+err.Error())
	}
	if st := s.NC.Status(); st != nats.CONNECTED {
		problems = append(problems, "nats: "+st.String())
	}
	if len(problems) > 0 {
		w.WriteHeader(http.StatusServiceUnavailable)
		for _, p := range problems {
			fmt.Fprintln(w, p)
		}
		return
	}
	w.Write([]byte("ready\n")) //nolint:errcheck
}

func (s *Service) run(name string, f func() error) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := f(); err != nil {
			s.errs <- fmt.Errorf("%s: %w", name, err)
		}
	}()
}

// HTTPAddr is the address the ingress listens on.
func (s *Service) HTTPAddr() string { return s.ln.Addr().String() }

// NATSURL is the URL of the JetStream server in use (the embedded one's when
// embedded).
func (s *Service) NATSURL() string { return s.NC.ConnectedUrl() }

// Errors reports a component that stopped with an error.
func (s *Service) Errors() <-chan error { return s.errs }

// Shutdown stops accepting requests, stops fetching, lets in-flight batches commit
// and ack, lets the relay finish its batch, and closes connections. If ctx ends
// first it returns ctx's error; unacked messages are redelivered later, so nothing
// is lost either way.
func (s *Service) Shutdown(ctx context.Context) error {
	if s.http != nil {
		_ = s.http.Shutdown(ctx)
	}
	if s.cancel != nil {
		s.cancel()
	}
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	var err error
	select {
	case <-done:
	case <-ctx.Done():
		err = fmt.Errorf("service: shutdown: %w", ctx.Err())
	}
	s.closeConns()
	return err
}

func (s *Service) closeConns() {
	if s.NC != nil {
		_ = s.NC.Drain()
		s.NC.Close()
	}
	if s.nats != nil {
		s.nats.Stop()
	}
	if s.Pool != nil {
		s.Pool.Close()
	}
	if s.stopPostgres != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := s.stopPostgres(ctx); err != nil {
			s.log.Warn("stopping the private Postgres", "err", err)
		}
	}
}

// traced continues the caller's trace (traceparent) in a server span, so the outbox
// rows written by the handler carry it on to the consumers.
func traced(tp trace.TracerProvider, next http.Handler) http.Handler {
	tracer := tp.Tracer("github.com/idemkit/idem/ingress")
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := propagation.TraceContext{}.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
		ctx, span := tracer.Start(ctx, r.Method+" "+r.URL.Path, trace.WithSpanKind(trace.SpanKindServer))
		defer span.End()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// withFault puts fault point point in front of a hook (which may be nil). An unarmed
// point leaves the hook as it is, so the normal binary pays nothing for it.
func withFault[T any](fs *faults.Set, point string, hook func(context.Context, T) error) func(context.Context, T) error {
	if !fs.Armed(point) {
		return hook
	}
	return func(ctx context.Context, v T) error {
		fs.Hit(point)
		if hook != nil {
			return hook(ctx, v)
		}
		return nil
	}
}

// chain2 and chain3 call an optional user callback and then the worker's own.
func chain2[A, B any](user, own func(A, B)) func(A, B) {
	if user == nil {
		return own
	}
	return func(a A, b B) { user(a, b); own(a, b) }
}

func chain3[A, B, C any](user, own func(A, B, C)) func(A, B, C) {
	if user == nil {
		return own
	}
	return func(a A, b B, c C) { user(a, b, c); own(a, b, c) }
}

// redact hides a password in a database URL for messages.
func redact(u string) string {
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil || cfg.ConnConfig.Password == "" {
		return u
	}
	return fmt.Sprintf("postgres://%s:***@%s:%d/%s", cfg.ConnConfig.User, cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Database)
}
