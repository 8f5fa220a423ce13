package install

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/installation"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/store"
	"github.com/idemkit/idem/internal/wake"
	"github.com/idemkit/idem/migrations"
)

// Config describes an installation. Stream's Name and Subjects are required; the
// zero value of every other field means its default.
type Config struct {
	// Schema is the Postgres schema of the idem_* tables (default "public").
	Schema string
	// Stream is the JetStream stream the installation publishes to and consumes
	// from; the worker creates it when it is absent.
	Stream Stream
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// TracerProvider makes the spans of the ingress, the outbox, the relay and the
	// consumers (default: the global provider, otel.GetTracerProvider). Trace
	// context travels through the global propagator (otel.SetTextMapPropagator).
	TracerProvider trace.TracerProvider
	// Observer is told what every component does (idem.Event), beside the
	// worker's own metrics.
	Observer idem.Observer
}

// Installation is one installation's shared parts; see the package documentation.
// It is safe for concurrent use. The pool and the connection stay the caller's:
// nothing here closes them.
type Installation struct {
	pool   *pgxpool.Pool
	js     jetstream.JetStream
	cfg    Config
	store  *store.Store
	waker  *wake.Waker
	tracer trace.TracerProvider

	mu sync.Mutex
	id string
}

// New returns the installation of pool's database and cfg.Schema, on nc's
// JetStream. It touches neither until a component runs. nc may be nil for a tool
// that only reads and writes the tables (dead letters, the consumer registry):
// the components that publish or consume refuse such an installation.
func New(pool *pgxpool.Pool, nc *nats.Conn, cfg Config) (*Installation, error) {
	if pool == nil {
		return nil, errors.New("install: a pgx pool is required")
	}
	if err := pgschema.Validate(cfg.Schema); err != nil {
		return nil, fmt.Errorf("install: %w", err)
	}
	if err := cfg.Stream.Validate(); err != nil {
		return nil, err
	}
	var js jetstream.JetStream
	if nc != nil {
		var err error
		if js, err = jetstream.New(nc); err != nil {
			return nil, fmt.Errorf("install: jetstream: %w", err)
		}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	tp := cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	cfg.Stream.Subjects = append([]string(nil), cfg.Stream.Subjects...)
	return &Installation{pool: pool, js: js, cfg: cfg, store: store.New(cfg.Schema), waker: &wake.Waker{}, tracer: tp}, nil
}

// Observing returns an installation that shares i's parts and tells every event
// to obs as well as to i's observer: how the worker adds its metrics.
func (i *Installation) Observing(obs idem.Observer) *Installation {
	c := &Installation{pool: i.pool, js: i.js, cfg: i.cfg, store: i.store, waker: i.waker, tracer: i.tracer, id: i.ID()}
	c.cfg.Observer = both(i.cfg.Observer, obs)
	return c
}

// Pool is the installation's Postgres pool.
func (i *Installation) Pool() *pgxpool.Pool { return i.pool }

// JetStream is the installation's JetStream context (nil without a connection).
func (i *Installation) JetStream() jetstream.JetStream { return i.js }

// Schema is the Postgres schema of the idem_* tables.
func (i *Installation) Schema() string { return pgschema.Name(i.cfg.Schema) }

// Stream is the installation's stream as configured (WithDefaults gives the
// stream as it would be created).
func (i *Installation) Stream() Stream { return i.cfg.Stream }

// Logger is the installation's logger.
func (i *Installation) Logger() *slog.Logger { return i.cfg.Logger }

// TracerProvider makes the installation's spans.
func (i *Installation) TracerProvider() trace.TracerProvider { return i.tracer }

// Observer is told what every component does; it may be nil.
func (i *Installation) Observer() idem.Observer { return i.cfg.Observer }

// idem's own packages read an installation's SQL and its relays' waker through
// package parts, so the public value exports no internal type.
func init() {
	parts.RegisterInstallation(func(inst any) parts.Installation {
		i := inst.(*Installation)
		return parts.Installation{Pool: i.pool, JS: i.js, Schema: i.Schema(), Stream: i.cfg.Stream.Name,
			Logger: i.cfg.Logger, Tracer: i.tracer, Observer: i.cfg.Observer,
			Store: i.store, Waker: i.waker, Identify: i.Identify,
			SchemaVersions: func(ctx context.Context) (int, int, error) {
				return migrations.Versions(ctx, i.pool, migrations.Config{Schema: i.cfg.Schema})
			}}
	})
}

// ID is the installation's old-style name, once known (Identify): the database
// cluster, the database and the schema of its tables. Empty before Identify.
func (i *Installation) ID() string {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.id
}

// Identify asks the database for the installation's old-style name, once:
// "<cluster's system identifier>/<database>/<schema>". It does not tell a physical
// copy of the database (a restored backup, a snapshot) from the original, and a
// rename or pg_upgrade changes it: durables record it only for messages and to
// adopt those bound before installation tokens. What names the installation is
// the token in idem_installation, which a durable records with the epoch of its
// last binding, so that a copy that falls behind is refused
// (consumer.ErrForkedDatabase).
func (i *Installation) Identify(ctx context.Context) (string, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.id != "" {
		return i.id, nil
	}
	id, err := installation.Of(ctx, i.pool, i.cfg.Schema)
	if err != nil {
		return "", fmt.Errorf("install: identify the installation: %w", err)
	}
	i.id = id
	return id, nil
}

// defaultStreamMaxAge is the stream's default MaxAge.
const defaultStreamMaxAge = 24 * time.Hour

// both calls a and then b, skipping a nil one.
func both(a, b idem.Observer) idem.Observer {
	switch {
	case a == nil:
		return b
	case b == nil:
		return a
	}
	return func(e idem.Event) {
		a(e)
		b(e)
	}
}
