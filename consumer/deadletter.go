package consumer

import (
	"context"
	"crypto/sha256"
	"encoding/json"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/otelmsg"
	"github.com/idemkit/idem/wire"
)

// deadLetter files d in idem_dead_letters with reason, then terminates it on the
// broker. If the row cannot be written the message is not terminated but naked, so
// it is never dropped without a trace.
//
// The row records the replay horizon (inbox_expires_at): until then this consumer's
// inbox still remembers whatever it did with the key, so a replay is folded if the
// effect already happened; after it, DeadLetters.Replay refuses unless forced.
func (c *Consumer) deadLetter(ctx context.Context, d *Delivery, reason string) {
	headers, _ := json.Marshal(d.Headers)
	var seq *int64
	if d.StreamSeq > 0 {
		s := int64(d.StreamSeq)
		seq = &s
	}
	fp := sha256.Sum256(d.Payload)
	message := wire.MessageOf(d.Subject, d.Name)
	tag, err := c.pool.Exec(ctx, c.st.DeadLetters.Insert, c.cfg.Name, d.Key, message, d.Subject, headers, d.Payload, reason, d.Deliveries, seq, fp[:], c.cfg.KeyLifetime)
	if err != nil {
		c.log.ErrorContext(ctx, "dead letter could not be written; message left for redelivery", "key", d.Key, "reason", reason, "err", err)
		c.retryLater(d, c.cfg.Backoff(d.Deliveries))
		return
	}
	if tag.RowsAffected() == 0 {
		// The same message (consumer, stream sequence, key, payload) was filed
		// before and its terminate was lost: the first row stands.
		c.log.WarnContext(ctx, "message dead-lettered again; already filed", "key", d.Key, "reason", reason, "deliveries", d.Deliveries, "stream_seq", d.StreamSeq)
	} else {
		c.log.WarnContext(ctx, "message dead-lettered", "key", d.Key, "reason", reason, "deliveries", d.Deliveries, "stream_seq", d.StreamSeq)
	}
	if err := d.raw.TermWithReason(truncate(reason, 200)); err != nil {
		c.log.WarnContext(ctx, "terminate failed; the redelivery will be dead-lettered again (once)", "key", d.Key, "err", err)
	}
	otelmsg.Failf(d.span, "dead-lettered: %s", truncate(reason, 200))
	c.observe(idem.OutcomeDeadLettered, 1, 0)
}
