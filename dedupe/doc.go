// Package dedupe is idem's Postgres inbox: the table "(consumer, key, message) ->
// first result" that turns at-least-once delivery into exactly-once effects.
//
// A delivery is named by its consumer, its intent's scoped key and its message
// (ID): the message tells apart the messages of one intent that one consumer reads,
// the subject or the subject and the name its producer gave it (idem.MessageOf).
// A row written before schema v5 has message "" and settles every message of its key.
//
// # How a message is folded
//
// A consumer processes a message inside one Postgres transaction that first claims
// the delivery:
//
//	INSERT INTO idem_inbox (consumer, key, message, fingerprint, ...) ... ON CONFLICT DO NOTHING RETURNING key, message
//
// A key that comes back is new: the handler runs in the same transaction and its
// result is stored on the row. A key that does not come back was claimed before — by
// an earlier delivery that committed, or by a concurrent one that commits first (the
// insert waits on the other transaction's uncommitted index entry, so two workers can
// never both see "new"). That delivery is a duplicate: the stored first result is
// returned and no effect runs. Because the claim and the effect commit together,
// there is no window in which one exists without the other: a crash before COMMIT
// loses both, and the redelivery runs the effect; a crash after COMMIT keeps both,
// and the redelivery is folded.
//
// # Fingerprints
//
// Each claim stores a fingerprint (SHA-256) of the payload. A later message with the
// same key and a different payload is not a retry but a producer bug; Claim judges it
// a Mismatch so the consumer can dead-letter it instead of merging it silently.
//
// # Batches
//
// Inbox.Claim claims many keys in one statement and judges each one Fresh, Duplicate
// or Mismatch. Keys are claimed in sorted order so two workers claiming overlapping
// batches wait on each other in the same order and cannot deadlock.
//
// # External effects
//
// An effect that cannot join the transaction (an email, a payment provider call) is
// claimed in two phases with a lease instead: Inbox.Lease commits the claim before
// the effect, Inbox.CompleteLease commits the result after it; see lease.go.
//
// # Lifetime
//
// Every row carries expires_at. A key must stay in the inbox longer than any window
// in which the same intent can still arrive: the stream's MaxAge, the consumer's
// redelivery horizon, the client's re-send horizon. Lifetimes.Check turns that into
// a start-up check (the worker package runs it and refuses to start); the worker's
// collector deletes expired rows in small batches. Storage is bounded by retention,
// never by shortening the lifetime.
//
// # Schema
//
// The table lives in the Postgres schema given to New (default public); every
// component of one installation must name the same schema.
package dedupe
