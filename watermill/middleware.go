package idemwatermill

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

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
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("idemwatermill: commit: %w", err)
	}
	log.Debug("message processed")
	return produced, nil
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
