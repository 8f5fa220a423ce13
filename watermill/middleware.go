package idemwatermill

import (
	"context"
	"errors"
	"fmt"

	"log/slog"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/wire"
)

// NewMiddleware returns a router middleware that runs each message's handler inside
// a Postgres transaction on inst's pool that first claims the message's
// idempotency key in inst's idem_inbox; see the package documentation. It logs
// through inst's logger. It fails if inst is nil or cfg is invalid. inst needs no
// NATS connection: the middleware only reads and writes the tables.
func NewMiddleware(inst *install.Installation, cfg Config) (message.HandlerMiddleware, error) {
	if inst == nil {
		return nil, errors.New("idemwatermill: nil installation")
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	in := &inbox{pool: inst.Pool(), inbox: dedupe.New(inst), cfg: cfg.withDefaults(), log: inst.Logger()}
	if cfg.OutboxSubject != "" {
		in.outbox = outbox.New(inst)
	}
	return func(next message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			return in.handle(next, msg)
		}
	}, nil
}

// Middleware is NewMiddleware for wiring code: it panics if inst is nil or cfg is
// invalid (a missing Consumer is a programming error, found at start-up).
//
// For each message: the key comes from the metadata "Idempotency-Key"; a missing
// or malformed key is a permanent error and the handler is not called. The key is
// claimed with the payload in a new transaction (dedupe.Inbox.Claim, a look-up). A duplicate
// (same key, same payload) is acked without calling the handler and produces no
// messages; the same key with another payload is a permanent error wrapping
// ErrFingerprintMismatch. A fresh key runs the handler with the transaction in
// msg.Context() (see TxFromContext): a handler error rolls the claim back and is
// returned unchanged, so the redelivery runs again; success settles the key
// (dedupe.Inbox.Settle, its one row) and commits it with the handler's writes, and
// returns the handler's messages. Of copies of one message handled at the same
// moment, each may run the handler, and one commits: the others' settlements fail
// (dedupe.ErrSettleConflict), their writes roll back, and each is claimed again
// and folded as a duplicate.
func Middleware(inst *install.Installation, cfg Config) message.HandlerMiddleware {
	m, err := NewMiddleware(inst, cfg)
	if err != nil {
		panic(err)
	}
	return m
}

// inbox is one configured middleware. It is safe for concurrent use: each message
// gets its own transaction from the pool.
type inbox struct {
	pool   *pgxpool.Pool
	inbox  *dedupe.Inbox
	outbox *outbox.Outbox // nil unless cfg.OutboxSubject is set
	cfg    Config
	log    *slog.Logger
}

func (in *inbox) handle(next message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	log := in.log.With(
		"consumer", in.cfg.Consumer,
		"topic", message.SubscribeTopicFromCtx(ctx),
		"message_uuid", msg.UUID,
	)

	key, err := keyOf(msg.Metadata)
	if err != nil {
		log.WarnContext(ctx, "message rejected: no valid idempotency key", "err", err)
		return nil, fmt.Errorf("idemwatermill: message %s: %w", msg.UUID, err)
	}
	log = log.With("key", key)
	if !wire.IsReplayFor(msg.Metadata.Get(idem.HeaderReplayFor), in.cfg.Consumer) {
		// A copy for other consumers (a dead-letter replay, a re-drive): this one
		// settled the message already, and its inbox may have forgotten the key.
		log.DebugContext(ctx, "copy for other consumers skipped", "for", msg.Metadata.Get(idem.HeaderReplayFor))
		return nil, nil
	}
	id, err := deliveryOf(ctx, key, msg.Metadata)
	if err != nil {
		log.WarnContext(ctx, "message rejected", "err", err)
		return nil, fmt.Errorf("idemwatermill: message %s: %w", msg.UUID, err)
	}
	// A copy of the message that another transaction settled while this one ran
	// its handler rolls this one back (dedupe.ErrSettleConflict); the next turn's
	// claim finds it settled. Each conflict is another transaction's commit, so a
	// second turn almost always settles it.
	for turn := 1; ; turn++ {
		produced, err := in.once(next, msg, log, key, id)
		if !errors.Is(err, dedupe.ErrSettleConflict) || turn == settleTurns {
			return produced, err
		}
		log.DebugContext(ctx, "a concurrent copy settled first; rolled back, claiming again", "err", err)
	}
}

// settleTurns bounds how often handle claims a message again after a conflict.
const settleTurns = 3

// once is one transaction: claim, handler, settlement, commit.
func (in *inbox) once(next message.HandlerFunc, msg *message.Message, log *slog.Logger, key string, id dedupe.ID) ([]*message.Message, error) {
	ctx := msg.Context()
	tx, err := in.pool.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("idemwatermill: begin: %w", err)
	}
	// Rollback is a no-op after Commit. It runs even if the message context is
	// cancelled, so the connection goes back to the pool clean.
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck

	// The one claim (look-up, fingerprint comparison) and settlement, shared with
	// idem's own consumer.
	claim := dedupe.Claim{Key: id.Key, Message: id.Message, Payload: msg.Payload}
	verdicts, err := in.inbox.Claim(ctx, tx, in.cfg.Consumer, []dedupe.Claim{claim})
	if err != nil {
		return nil, fmt.Errorf("idemwatermill: %w", err)
	}
	switch v := verdicts[id]; v {
	case dedupe.Fresh:
	case dedupe.Duplicate:
		log.DebugContext(ctx, "duplicate folded")
		return nil, nil
	case dedupe.Mismatch:
		log.WarnContext(ctx, "message rejected: key reused with a different payload")
		return nil, Permanent(fmt.Errorf("%w (consumer %q, key %q)", ErrFingerprintMismatch, in.cfg.Consumer, key))
	default:
		return nil, fmt.Errorf("idemwatermill: claim of key %q: unexpected verdict %v", key, v)
	}

	// The handler sees the transaction; the outer middlewares get the original
	// context back, so no finished transaction leaks out with the message.
	msg.SetContext(ContextWithTx(ctx, tx))
	defer msg.SetContext(ctx)
	produced, err := next(msg)
	if err != nil {
		// The deferred rollback takes the claim with it: the redelivery runs again.
		log.DebugContext(ctx, "handler failed; claim rolled back", "err", err)
		return nil, err
	}
	if in.outbox != nil && len(produced) > 0 {
		if err := in.enqueueProduced(ctx, tx, key, produced); err != nil {
			// Rolled back with the claim: the redelivery runs the handler again,
			// unless the error is permanent (a message that can never be an outbox
			// message), which the poison queue files.
			log.WarnContext(ctx, "produced messages not written to the outbox; claim rolled back", "err", err)
			return nil, err
		}
		produced = nil
	}
	// The delivery's one inbox row, with the handler's writes.
	if err := in.inbox.Settle(ctx, tx, in.cfg.Consumer, []dedupe.Settlement{{Claim: claim}}, in.cfg.KeyLifetime); err != nil {
		return nil, fmt.Errorf("idemwatermill: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("idemwatermill: commit: %w", err)
	}
	log.DebugContext(ctx, "message processed")
	return produced, nil
}

// enqueueProduced writes a handler's returned messages into the outbox inside tx,
// keying each one that has no key of its own.
func (in *inbox) enqueueProduced(ctx context.Context, tx pgx.Tx, scopedKey string, produced []*message.Message) error {
	scope, key, err := idem.ParseScopedKey(scopedKey)
	if err != nil {
		return fmt.Errorf("idemwatermill: produced messages: incoming key: %w", err)
	}
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
	}
	if err := enqueue(ctx, in.outbox, tx, in.cfg.OutboxSubject, produced); err != nil {
		return fmt.Errorf("idemwatermill: produced messages: %w", err)
	}
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
