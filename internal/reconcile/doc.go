// Package reconcile proves that every published intent reached every consumer that
// should see it, and re-publishes what the stream lost.
//
// The relay marks an outbox row published when JetStream acknowledges it. An
// acknowledgement is not a delivery: a broker that fsyncs every two minutes (the
// JetStream default) can lose acknowledged writes on power loss; a stream can be
// purged, deleted and recreated, or expire a message (MaxAge) while its consumers are
// down; a durable consumer can be deleted, or be acked past by something that is not
// the consumer. None of these leaves a trace in the outbox. The reconciler makes
// delivery something idem proves instead of something it assumes.
//
// # What proof is
//
// The relay records each row's PubAck (stream and sequence). Consumers register
// themselves in idem_consumers when they start: name, stream, filter subject, key
// lifetime, redelivery horizon and where they start. An intent's row is complete
// when every registered consumer that should see it (Expected: it reads the row's
// subject in that stream, its start is not after the row was written, and, for a
// copy naming consumers in Idem-Replay-For, it is named) has settled the delivery —
// (consumer, key, message): an inbox row that is done and not expired, or a dead
// letter filed since the row was written. An expired row proves nothing, since its
// consumer may forget it at any moment; and a replay is not proven by the dead
// letter it replays, so a replay the stream lost is re-driven like any other row.
//
// # What the reconciler does
//
// A pass takes the published, unproven rows of its stream in batches (FOR UPDATE
// SKIP LOCKED, so several reconcilers share the work and never judge a row twice at
// once) and sorts each:
//
//   - settled by every expected consumer: complete. Its expires_at is set (now plus
//     Retention), and only then may the collector delete it. The relay sets no
//     expiry on rows it publishes when it awaits proof (relay.Config.AwaitProof),
//     so a row is never deleted by age alone.
//   - published less than After ago: in flight, left alone.
//   - read by no registered consumer: unrouted, reported; dead-lettered under the
//     relay's name ("(relay)") once past UnroutedHorizon, with a horizon that has
//     passed: a consumer outside the registry may have read it.
//   - otherwise it is looked for in the stream (once per After, not on every pass).
//     Still there and not acked past by the missing consumers' durables (this
//     installation's: another installation's acks say nothing here): lag, reported
//     and left. Gone — the stream does not exist, the sequence is below its first
//     or beyond its last, the message there carries another Nats-Msg-Id (the stream
//     was recreated), or a missing consumer acked past it without settling it —
//     re-driven: the row goes back to the relay under a new Msg-Id generation, with
//     Idem-Replay-For naming the consumers still missing it, so the broker's
//     duplicate window does not fold it into the lost original and the consumers
//     that settled it ack the copy without an effect.
//   - gone, but older than the re-drive horizon: alerted. A copy stays in the
//     stream for its MaxAge, and each consumer that reads the subject may forget
//     the key its KeyLifetime after the row was written; past the shortest
//     KeyLifetime less MaxAge less Margin a copy could outlive a reader's memory,
//     so the row is given up on and each missing consumer gets a dead letter
//     saying why, with a replay horizon that has passed (a replay then needs
//     --force, knowingly).
//
// The reconciler never causes a second effect: a re-driven message carries the same
// Idempotency-Key and reaches only the consumers missing it, each of which folds it
// in its inbox, or folds a late original into it.
//
// # With the broker's fsync off
//
// Because a lost message is found and re-driven, JetStream's fsync interval stops
// being a correctness requirement and becomes a performance choice: a broker that
// loses its last seconds of acknowledged writes delays those effects by about After,
// it does not lose them. The worker runs a reconciler wherever it runs the relay.
//
// # Consumers in other databases
//
// Proof reads the consumers' inbox and dead letters in the outbox's database. A
// consumer whose inbox lives elsewhere must send its settlement back — see
// docs/ARCHITECTURE.md, "Consumers in other databases".
package reconcile
