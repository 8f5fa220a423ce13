// Package dedupe is idem's Postgres inbox: the table "(consumer, key, message) ->
// first result" that turns at-least-once delivery into exactly-once effects.
//
// A delivery is named by its consumer, its intent's scoped key and its message
// (ID): the message tells apart the messages of one intent that one consumer reads,
// the subject or the subject and the name its producer gave it (wire.MessageOf).
// A row written before schema v5 has message "" and settles every message of its key.
//
// # How a message is folded
//
// A consumer processes a message inside one Postgres transaction that claims the
// delivery, runs the effect and settles the delivery:
//
//	BEGIN
//	Inbox.Claim    look the delivery up: Fresh, Duplicate or Mismatch      (writes nothing)
//	               ... the effect, in the same transaction, if Fresh ...
//	Inbox.Settle   INSERT the delivery's one row: done, fingerprint, result
//	COMMIT
//
// A delivery the inbox knows is a duplicate: the stored first result is returned
// and no effect runs. A fresh one runs its effect, and its row is written once,
// finished, in the effect's transaction. Because the row and the effect commit
// together, there is no window in which one exists without the other: a crash
// before COMMIT loses both, and the redelivery runs the effect; a crash after
// COMMIT keeps both, and the redelivery is folded.
//
// Two copies of one delivery processed at the same moment both find it fresh and
// both run the effect, each in its own transaction; the primary key lets only one
// of them commit. The second one's Settle waits for the first transaction and, if
// it committed, fails with ErrSettleConflict: the second rolls back, effect and
// all, and runs again, finding the delivery a duplicate. (A handler's effect may
// run in a transaction that rolls back for other reasons too: a batch-mate that
// fails, a crash.) A partitioned inbox, whose primary key cannot make a delivery
// unique (package partition), serialises the copies with a per-key advisory lock
// taken by Claim instead: the second waits in Claim and finds the delivery settled.
//
// # Fingerprints
//
// Each row stores a fingerprint (SHA-256) of the payload. A later message with the
// same key and a different payload is not a retry but a producer bug; Claim judges it
// a Mismatch so the consumer can dead-letter it instead of merging it silently.
//
// # Batches
//
// Inbox.Claim judges many deliveries in one statement and Inbox.Settle writes many
// in one statement. Deliveries are settled (and locked, on a partitioned inbox) in
// sorted order, so two workers with overlapping batches wait on each other in the
// same order and cannot deadlock.
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
