// Package outbox is idem's transactional outbox: the producer's half of "once".
//
// A producer writes its business rows and the message announcing them in one
// Postgres transaction, so the message exists if and only if the business rows do:
//
//	tx, _ := pool.Begin(ctx)
//	tx.Exec(ctx, `INSERT INTO orders ...`)
//	ob.Enqueue(ctx, tx, idem.Message{Key: scopedKey, Subject: "orders.created", Payload: body})
//	tx.Commit(ctx)
//
// The worker's relay then moves committed rows to JetStream. It claims unpublished rows in
// batches (FOR UPDATE SKIP LOCKED, so several relays share one outbox), publishes
// each with the headers Idempotency-Key (the scoped key) and Nats-Msg-Id (derived
// from subject and key, idem.MsgID), and marks the rows published only after their
// PubAcks arrive. A relay that dies between publish and mark publishes the rows
// again: the broker folds the repeat by Msg-Id inside its duplicate window, and the
// consumers' inboxes fold it after. So the outbox is at-least-once toward the
// broker by design; "once" is decided at the inbox.
//
// The relay is woken by a NOTIFY sent at commit, with a poll as fallback. A NOTIFY
// inside a transaction serialises its commit with every other notifying
// transaction's, which a busy ingress pays for in commit rate; so a caller on the
// hot path pipelines its INSERT with AddToBatch and calls Wake after its commit
// instead. Wake reaches a relay of the same process and installation directly
// and otherwise sends one coalesced NOTIFY outside any transaction. The producer
// middleware works this way.
//
// # Topology
//
// An Outbox belongs to an installation (package install): the stream's subjects
// make Enqueue refuse a subject no stream would store, its broker's max_payload
// refuses a message it could never carry, and the relay expects every publish to
// land in the installation's stream, so a subject captured by some other stream is
// an error rather than a silent misroute. idem_outbox lives in the installation's
// schema.
package outbox
