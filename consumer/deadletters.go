package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
)

// deadLetter files d in idem_dead_letters with reason, then terminates it on the
// broker. If the row cannot be written the message is not terminated but naked, so
// it is never dropped without a trace.
func (c *Consumer) deadLetter(ctx context.Context, d *Delivery, reason string) {
	headers, _ := json.Marshal(d.Headers)
	var seq *int64
	if d.StreamSeq > 0 {
		s := int64(d.StreamSeq)
		seq = &s
	}
	if _, err := c.pool.Exec(ctx, sqlInsertDeadLetter, c.cfg.Name, d.Key, d.Subject, headers, d.Payload, reason, d.Deliveries, seq); err != nil {
		c.log.Error("dead letter could not be written; message left for redelivery", "key", d.Key, "reason", reason, "err", err)
		_ = d.raw.NakWithDelay(c.cfg.Backoff(d.Deliveries))
		c.count(OutcomeFailed, 1)
		return
	}
	c.log.Warn("message dead-lettered", "key", d.Key, "reason", reason, "deliveries", d.Deliveries, "stream_seq", d.StreamSeq)
	if err := d.raw.TermWithReason(truncate(reason, 200)); err != nil {
		c.log.Warn("terminate failed; the redelivery will be dead-lettered again (once)", "key", d.Key, "err", err)
	}
	c.count(OutcomeDeadLettered, 1)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// DeadLetter is one row of idem_dead_letters.
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

// ListDeadLetters returns up to limit dead letters, newest first.
func ListDeadLetters(ctx context.Context, pool *pgxpool.Pool, limit int) ([]DeadLetter, error) {
	rows, err := pool.Query(ctx, sqlListDeadLetters, limit)
	if err != nil {
		return nil, fmt.Errorf("consumer: list dead letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, scanDeadLetter)
	if err != nil {
		return nil, fmt.Errorf("consumer: list dead letters: %w", err)
	}
	return out, nil
}

// GetDeadLetter returns one dead letter.
func GetDeadLetter(ctx context.Context, pool *pgxpool.Pool, id int64) (DeadLetter, error) {
	rows, err := pool.Query(ctx, sqlGetDeadLetter, id)
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

// ReplayDeadLetter publishes dead letter id again, with the same Idempotency-Key and
// a Nats-Msg-Id of its own (so the broker's de-duplication window does not swallow
// it, nor a second replay), and records when. Replaying a message whose effect already happened is still
// a duplicate: the inbox folds it by key. Replaying a message that has no key, or a
// fingerprint mismatch, will be dead-lettered again: fix the producer instead.
func ReplayDeadLetter(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, id int64) (DeadLetter, error) {
	dl, err := GetDeadLetter(ctx, pool, id)
	if err != nil {
		return dl, err
	}
	msg := nats.NewMsg(dl.Subject)
	for k, v := range dl.Headers {
		msg.Header.Set(k, v)
	}
	if dl.Key != "" {
		msg.Header.Set(idem.HeaderKey, dl.Key)
	}
	// Each replay gets its own Msg-Id, so even a second replay of the same dead
	// letter reaches the consumer, whose inbox (not the broker) decides.
	msg.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("%s replay-%d-%d", idem.MsgID(dl.Subject, dl.Key), id, time.Now().UnixNano()))
	msg.Data = dl.Payload
	if _, err := js.PublishMsg(ctx, msg); err != nil {
		return dl, fmt.Errorf("consumer: replay dead letter %d: publish: %w", id, err)
	}
	if _, err := pool.Exec(ctx, sqlMarkReplayed, id); err != nil {
		return dl, fmt.Errorf("consumer: replay dead letter %d: published, but recording it failed: %w", id, err)
	}
	return dl, nil
}
