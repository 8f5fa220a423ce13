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
// The Relay then moves committed rows to JetStream. It claims unpublished rows in
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
// transaction's, which costs a busy ingress a third of its commit rate; so a
// caller on the hot path pipelines its INSERT with AddToBatch and calls Wake after
// its commit instead. Wake reaches a relay of the same process directly
// (RelayConfig.Outbox) and otherwise sends one coalesced NOTIFY outside any
// transaction. The producer middleware works this way.
//
// # Topology
//
// Stream name and subjects belong to the user. Config.Subjects (the stream's subject
// filters) makes Enqueue refuse a subject no stream would store; EnsureStream
// creates the stream when it is absent; RelayConfig.Stream makes every publish
// expect that stream, so a subject captured by some other stream is an error rather
// than a silent misroute.
//
// # Schema
//
// idem_outbox lives in the Postgres schema named by Config.Schema and
// RelayConfig.Schema (default public); both must name the same one.
package outbox
