package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/outbox"
)

// DeadLetter is one row of idem_dead_letters: a message that can never succeed as it
// is, with the reason.
type DeadLetter struct {
	ID         int64             `json:"id"`
	Consumer   string            `json:"consumer"`
	Key        string            `json:"key"`
	Subject    string            `json:"subject"`
	Headers    map[string]string `json:"headers"`
	Payload    []byte            `json:"payload"`
	Reason     string            `json:"reason"`
	Deliveries int               `json:"deliveries"`
	CreatedAt  time.Time         `json:"created_at"`
	ReplayedAt *time.Time        `json:"replayed_at,omitempty"`
}

// DeadLetters is the operator's view of idem_dead_letters: list, inspect, replay.
type DeadLetters struct {
	pool   *pgxpool.Pool
	q      queries
	outbox *outbox.Outbox
}

// NewDeadLetters returns the dead letters of schema (default "public") in pool.
func NewDeadLetters(pool *pgxpool.Pool, schema string) (*DeadLetters, error) {
	if err := pgschema.Validate(schema); err != nil {
		return nil, fmt.Errorf("consumer: dead letters: %w", err)
	}
	ob, err := outbox.New(outbox.Config{Schema: schema})
	if err != nil {
		return nil, err
	}
	return &DeadLetters{pool: pool, q: newQueries(schema), outbox: ob}, nil
}

// List returns up to limit dead letters, newest first.
func (dl *DeadLetters) List(ctx context.Context, limit int) ([]DeadLetter, error) {
	rows, err := dl.pool.Query(ctx, dl.q.listDeadLetters, limit)
	if err != nil {
		return nil, fmt.Errorf("consumer: list dead letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, scanDeadLetter)
	if err != nil {
		return nil, fmt.Errorf("consumer: list dead letters: %w", err)
	}
	return out, nil
}

// Get returns one dead letter.
func (dl *DeadLetters) Get(ctx context.Context, id int64) (DeadLetter, error) {
	return getDeadLetter(ctx, dl.pool, dl.q.getDeadLetter, id)
}

// Replay puts dead letter id back on its way, with its original key: it writes the
// message into the outbox under a new Msg-Id generation (so the broker's duplicate
// window does not swallow it, nor a second replay) and records the replay, in one
// transaction. The relay publishes it. A replay of a message whose effect already
// happened is still a duplicate: the inbox folds it by key. A message without a
// valid key cannot be replayed: fix its producer instead.
func (dl *DeadLetters) Replay(ctx context.Context, id int64) (DeadLetter, error) {
	var out DeadLetter
	err := pgx.BeginFunc(ctx, dl.pool, func(tx pgx.Tx) error {
		d, err := getDeadLetter(ctx, tx, dl.q.getDeadLetterForUpdate, id)
		if err != nil {
			return err
		}
		headers := make(map[string]string, len(d.Headers))
		for k, v := range d.Headers {
			if k != idem.HeaderKey && k != idem.HeaderMsgID {
				headers[k] = v // the relay sets both afresh
			}
		}
		msg := idem.Message{Key: d.Key, Subject: d.Subject, Headers: headers, Payload: d.Payload}
		generation := fmt.Sprintf("replay-%d-%d", id, time.Now().UnixNano())
		if err := dl.outbox.Republish(ctx, tx, generation, msg); err != nil {
			return fmt.Errorf("consumer: replay dead letter %d: %w", id, err)
		}
		if _, err := tx.Exec(ctx, dl.q.markReplayed, id); err != nil {
			return fmt.Errorf("consumer: replay dead letter %d: record: %w", id, err)
		}
		out = d
		return nil
	})
	return out, err
}

type queryer interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

func getDeadLetter(ctx context.Context, db queryer, sql string, id int64) (DeadLetter, error) {
	rows, err := db.Query(ctx, sql, id)
	if err != nil {
		return DeadLetter{}, fmt.Errorf("consumer: dead letter %d: %w", id, err)
	}
	dl, err := pgx.CollectExactlyOneRow(rows, scanDeadLetter)
	if errors.Is(err, pgx.ErrNoRows) {
		return DeadLetter{}, fmt.Errorf("consumer: dead letter %d: not found", id)
	}
	if err != nil {
		return DeadLetter{}, fmt.Errorf("consumer: dead letter %d: %w", id, err)
	}
	return dl, nil
}

func scanDeadLetter(row pgx.CollectableRow) (DeadLetter, error) {
	var dl DeadLetter
	var headers []byte
	err := row.Scan(&dl.ID, &dl.Consumer, &dl.Key, &dl.Subject, &headers, &dl.Payload, &dl.Reason, &dl.Deliveries, &dl.CreatedAt, &dl.ReplayedAt)
	if err == nil && len(headers) > 0 {
		err = json.Unmarshal(headers, &dl.Headers)
	}
	return dl, err
}
