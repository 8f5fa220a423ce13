package idemwatermill

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dedupe"
)

// Config configures Middleware. The zero value of every optional field means its
// default.
type Config struct {
	// Consumer names the consumer in idem_inbox (its consumer column). Keys are
	// unique per consumer: two handlers that must each see every message need two
	// names. Required.
	Consumer string
	// KeyLifetime is how long a claimed key is remembered (default
	// dedupe.DefaultLifetime). It must outlast every window in which the same
	// message can be delivered again; see dedupe.CheckLifetimes.
	KeyLifetime time.Duration
	// OutboxSubject, when set, routes the messages a handler returns through idem's
	// outbox: they are written to idem_outbox on this subject inside the message's
	// transaction, so they commit with the claim and the handler's writes (or not
	// at all), and none is handed back to the router. idem's relay publishes them.
	// Without it the router publishes returned messages itself after the commit,
	// where a failed publish loses them (see the package documentation). A
	// returned message without Idempotency-Key metadata gets one derived from the
	// consumer, the incoming key and its position (DerivedKey), in the incoming
	// message's scope. Must be a literal subject under "idem.".
	OutboxSubject string
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

func (c Config) validate() error {
	switch {
	case c.Consumer == "":
		return errors.New("idemwatermill: Config.Consumer is required")
	case c.KeyLifetime < 0:
		return errors.New("idemwatermill: Config.KeyLifetime must not be negative")
	}
	if c.OutboxSubject != "" {
		if err := checkSubject(c.OutboxSubject); err != nil {
			return fmt.Errorf("idemwatermill: Config.OutboxSubject: %w", err)
		}
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.KeyLifetime == 0 {
		c.KeyLifetime = dedupe.DefaultLifetime
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// NewMiddleware returns a router middleware that runs each message's handler inside
// a Postgres transaction that first claims the message's idempotency key in
// idem_inbox; see the package documentation. It fails if pool is nil or cfg is
// invalid.
func NewMiddleware(pool *pgxpool.Pool, cfg Config) (message.HandlerMiddleware, error) {
	if pool == nil {
		return nil, errors.New("idemwatermill: nil pool")
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	in := &inbox{pool: pool, cfg: cfg.withDefaults()}
	return func(next message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			return in.handle(next, msg)
		}
	}, nil
}

// Middleware is NewMiddleware for wiring code: it panics if pool is nil or cfg is
// invalid (a missing Consumer is a programming error, found at start-up).
//
// For each message: the key comes from the metadata "Idempotency-Key"; a missing
// or malformed key is a permanent error and the handler is not called. The key is
// claimed in a new transaction with the payload's fingerprint. A duplicate (same
// key, same payload) is acked without calling the handler and produces no
// messages; the same key with another payload is a permanent error wrapping
// ErrFingerprintMismatch. A new key runs the handler with the transaction in
// msg.Context() (see TxFromContext): a handler error rolls the claim back and is
// returned unchanged, so the redelivery runs again; success commits the claim with
// the handler's writes and returns the handler's messages.
func Middleware(pool *pgxpool.Pool, cfg Config) message.HandlerMiddleware {
	m, err := NewMiddleware(pool, cfg)
	if err != nil {
		panic(err)
	}
	return m
}

// inbox is one configured middleware. It is safe for concurrent use: each message
// gets its own transaction from the pool.
type inbox struct {
	pool *pgxpool.Pool
	cfg  Config
}

func (in *inbox) handle(next message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	log := in.cfg.Logger.With(
		"consumer", in.cfg.Consumer,
		"topic", message.SubscribeTopicFromCtx(ctx),
		"message_uuid", msg.UUID,
	)

	key, err := keyOf(msg.Metadata)
	if err != nil {
		log.Warn("message rejected: no valid idempotency key", "err", err)
		return nil, fmt.Errorf("idemwatermill: message %s: %w", msg.UUID, err)
	}
	log = log.With("key", key)
	fingerprint := dedupe.Fingerprint(msg.Payload)

	tx, err := in.pool.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("idemwatermill: begin: %w", err)
	}
	// Rollback is a no-op after Commit. It runs even if the message context is
	// cancelled, so the connection goes back to the pool clean.
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck

	fresh, err := dedupe.ClaimBatch(ctx, tx, in.cfg.Consumer,
		[]dedupe.Claim{{Key: key, Fingerprint: fingerprint}}, in.cfg.KeyLifetime)
	if err != nil {
		return nil, fmt.Errorf("idemwatermill: claim: %w", err)
	}
	if !fresh[key] {
		return nil, in.duplicate(ctx, log, tx, key, fingerprint)
	}

	// The handler sees the transaction; the outer middlewares get the original
	// context back, so no finished transaction leaks out with the message.
	msg.SetContext(ContextWithTx(ctx, tx))
	defer msg.SetContext(ctx)
	produced, err := next(msg)
	if err != nil {
		// The deferred rollback takes the claim with it: the redelivery runs again.
		log.Debug("handler failed; claim rolled back", "err", err)
		return nil, err
	}
	if in.cfg.OutboxSubject != "" && len(produced) > 0 {
		if err := in.enqueueProduced(ctx, tx, key, produced); err != nil {
			// Rolled back with the claim: the redelivery runs the handler again. A
			// message that cannot be a NATS message never will be: permanent.
			log.Warn("produced messages not written to the outbox; claim rolled back", "err", err)
			return nil, err
		}
		produced = nil
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("idemwatermill: commit: %w", err)
	}
	log.Debug("message processed")
	return produced, nil
}

// enqueueProduced writes a handler's returned messages into the outbox inside tx,
// keying each one that has no key of its own.
func (in *inbox) enqueueProduced(ctx context.Context, tx pgx.Tx, scopedKey string, produced []*message.Message) error {
	scope, key := idem.SplitScopedKey(scopedKey)
	for i, m := range produced {
		if m.Metadata == nil {
			m.Metadata = message.Metadata{}
		}
		if m.Metadata.Get(idem.HeaderKey) == "" {
			m.Metadata.Set(idem.HeaderKey, DerivedKey(in.cfg.Consumer, string(key), i))
			if scope != "" && m.Metadata.Get(idem.HeaderScope) == "" {
				m.Metadata.Set(idem.HeaderScope, scope)
			}
		}
		m.SetContext(ctx)
		// A message that cannot become an outbox message (a malformed key, metadata
		// that cannot be a NATS header) never will: permanent, not retried.
		if _, err := toIdem(in.cfg.OutboxSubject, m); err != nil {
			return Permanent(fmt.Errorf("idemwatermill: produced message %d (%s): %w", i, m.UUID, err))
		}
	}
	if err := NewOutboxPublisher(tx).Publish(in.cfg.OutboxSubject, produced...); err != nil {
		return fmt.Errorf("idemwatermill: produced messages: %w", err)
	}
	return nil
}

// DerivedKey is the idempotency key of the i-th message a handler produced for the
// incoming key, when the handler gave it none: "consumer:key:i", or a SHA-256 of it
// in hex when that is not a valid key (too long, or unprintable bytes). It is a
// pure function of the intent, so the same intent always produces the same keys.
func DerivedKey(consumer, key string, i int) string {
	k := fmt.Sprintf("%s:%s:%d", consumer, key, i)
	if _, err := idem.ParseKey(k); err == nil {
		return k
	}
	sum := sha256.Sum256([]byte(k))
	return hex.EncodeToString(sum[:])
}

// duplicate decides what a key that was already claimed means: nil for a true
// redelivery (ack it, run nothing), a permanent error for a reused key.
func (in *inbox) duplicate(ctx context.Context, log *slog.Logger, tx pgx.Tx, key string, fingerprint []byte) error {
	recs, err := dedupe.Lookup(ctx, tx, in.cfg.Consumer, []string{key})
	if err != nil {
		return fmt.Errorf("idemwatermill: look up: %w", err)
	}
	rec, ok := recs[key]
	switch {
	case !ok:
		// A concurrent first delivery held the key and rolled back between our claim
		// and our look-up. Not a duplicate: let the broker redeliver it.
		return fmt.Errorf("idemwatermill: key %q vanished between claim and look-up; will be redelivered", key)
	case !rec.Matches(fingerprint):
		log.Warn("message rejected: key reused with a different payload")
		return Permanent(fmt.Errorf("%w (consumer %q, key %q)", ErrFingerprintMismatch, in.cfg.Consumer, key))
	}
	log.Debug("duplicate folded", "first_seen", rec.CreatedAt)
	return nil
}

type txKey struct{}

// ContextWithTx returns ctx carrying tx. Middleware uses it to hand its transaction
// to the handler; tests and custom middlewares may use it too.
func ContextWithTx(ctx context.Context, tx pgx.Tx) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}

// TxFromContext returns the transaction Middleware opened for the message whose
// context is ctx (msg.Context() in a handler). Write the message's effects through
// it so they commit with the claim. Do not Commit or Roll back the transaction:
// the middleware does, according to the handler's result.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(pgx.Tx)
	return tx, ok && tx != nil
}
