// Package dedupe is idem's Postgres inbox: the table "(consumer, key) -> first result"
// that turns at-least-once delivery into exactly-once effects.
//
// # How a message is folded
//
// A consumer processes a message inside one Postgres transaction that first claims
// the message's key:
//
//	INSERT INTO idem_inbox (consumer, key, fingerprint, ...) ... ON CONFLICT DO NOTHING RETURNING key
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
// same key and a different payload is not a retry but a producer bug; Lookup reports
// it so the consumer can dead-letter it instead of merging it silently.
//
// # Batches
//
// ClaimBatch claims many keys in one statement. Keys are claimed in sorted order so
// two workers claiming overlapping batches wait on each other in the same order and
// cannot deadlock.
//
// # Lifetime
//
// Every row carries expires_at. A key must stay in the inbox longer than any window
// in which the same intent can still arrive: the stream's MaxAge, the consumer's
// redelivery horizon, the client's re-send horizon. CheckLifetimes turns that into
// a start-up check; Collector deletes expired rows in small batches.
package dedupe
