// Package consumer is idem's consuming half of "once": a JetStream pull engine that
// runs a handler at most once per idempotency key, whatever the broker redelivers.
//
// A Consumer reads a durable pull consumer (Config.Name on its installation's
// stream, filtered by Config.Subject). Every delivery carries its intent's scoped key in the
// Idempotency-Key header; the delivery is claimed in idem_inbox under (consumer,
// key, message) — the message being its subject, or its subject and the name its
// producer gave it (wire.MessageOf) — and the effect runs only for a delivery that
// was new. Redeliveries, re-publishes by the relay, re-drives, replays and producer
// retries all fold into the first result; two messages of one intent are two
// deliveries.
//
// The durable belongs to one installation (the database and schema of the inbox),
// whose token it records in its metadata with the epoch of its last binding: a
// consumer of another installation with the same Name is refused
// (ErrForeignDurable), and so is one whose database is behind the durable's epoch,
// a copy of the database that another copy has bound since (ErrForkedDatabase).
// Config.Start says where a consumer new to the installation starts reading; by
// default a new name that looks like a rename of a registered consumer is refused
// (ErrLikelyRenamed): rename the old one (Rename) so the new name keeps its inbox.
//
// worker.Worker runs its consumers and stops them in two steps. A Consumer run on
// its own stops the same way with RunWork(ctx, work): ctx ending stops the
// fetching and lets the work in flight finish, work ending cancels it. Run(ctx)
// has the soft stop only.
//
// # In-transaction handlers
//
// A Handler (or a BatchHandler, which writes a whole batch with one statement) runs
// inside the Postgres transaction that claims the keys:
//
//	BEGIN
//	  SELECT ... FROM idem_inbox                    -- claim: which deliveries are new
//	  handler(ctx, tx, deliveries of the new keys)  -- the effect, in tx
//	  INSERT INTO idem_inbox ...                    -- one finished row per new delivery, with its result
//	COMMIT
//	ack every delivery
//
// The inbox row and the effect commit together, so there is no moment in which one
// exists without the other: a crash before COMMIT loses both and the redelivery
// runs the effect; a crash after COMMIT (before the ack) keeps both and the
// redelivery is folded. Exactly once, by construction. Two copies of a delivery in
// two batches at the same moment may both run the handler; the inbox's primary key
// lets one commit, and the other batch rolls back and runs again, folding the copy
// (package dedupe). A handler's effect may thus run in a transaction that rolls
// back, as it may when a batch-mate fails: everything it does must go through tx.
//
// Messages that arrive one by one share a transaction: a batch that is not full
// waits for more, up to 2ms after its first message arrived (never longer, and
// not at all once BatchSize messages are there or the consumer is stopping), so
// that at a moderate rate a commit carries several messages instead of one.
//
// A handler error (or panic) rolls the batch back; the failing delivery is taken out
// and retried after Backoff, and the rest of the batch runs again without it. Past
// MaxDeliver attempts, or at once for an error wrapped with Permanent, the message
// is dead-lettered.
//
// # What counts as an attempt
//
// Only a message's own attempts count toward MaxDeliver, and they are counted in
// Postgres (idem_attempts), not by JetStream's delivery count, which also counts
// deliveries lost to a database outage or to a batch-mate that crashed the worker.
// A failed handler is charged; a redelivered message (its worker may have died on
// it) is charged when it starts and runs alone, so a message that kills its worker
// uses up its own budget, not its batch-mates'. A first delivery costs no write.
//
// A database that cannot be reached is nobody's message's fault: the consumer
// holds the messages it has (in-progress heartbeats keep them), waits with a
// growing pause and tries again, instead of naking them into a storm of
// redeliveries.
//
// # External effects
//
// An ExternalHandler performs an effect that cannot join a transaction (SMTP, a
// payment provider). The claim is split in two committed phases around it:
//
//  1. Lease: claim the key as leased for LeaseFor, and commit.
//  2. Perform the effect, passing the key downstream (Effect.Key, Effect.KeyFor).
//     Meanwhile the lease is extended and JetStream gets in-progress heartbeats; a
//     multi-step handler records recovery points (Effect.Checkpoint).
//  3. Complete: store the result, mark the key done, and commit. Then ack.
//
// A delivery of a key that is done is acked without an effect. One that finds a
// live lease (another worker is performing it right now) is handed back to be
// retried when that lease would end. One that finds an expired lease — its worker
// died mid-effect — takes it over and performs the effect again, with the same
// key, from the last recovery point.
//
// What this guarantees: the window between the effect reaching the downstream and
// step 3 committing cannot be closed by any local transaction. So toward a
// downstream that honours the key (a provider's Idempotency-Key, a mail system that
// dedupes on Message-ID) the effect is exactly once; toward one that does not, at
// least once — never silently zero: a key is marked done only after Perform
// returned success, and a message is acked only after that, or dead-lettered with
// its reason. Never two attempts at once: a live lease makes every other delivery
// back off, and a holder that cannot extend its lease (its database stalls, it is
// partitioned) cancels its own Perform before the lease can have run out, by its
// own clock (LeaseFor after it sent the last successful extension, minus a
// margin); a handler must stop when its context is cancelled.
//
// What it costs: by default one external effect runs at a time per consumer
// (Config.Concurrency; raise it for a slow downstream), and the
// effect of a worker that died mid-way is taken over only when its lease has run
// out (Config.LeaseFor, 30s).
//
// The short example is ExternalHandlerFunc's: a confirmation to an HTTP service
// that honours an Idempotency-Key. Examples that need a database and a broker live
// in package idemtest (github.com/idemkit/idem/idemtest), whose Start gives them a
// database and a connection to the broker: an in-transaction consumer run by hand (Example, InTransactionConsumer),
// and a three-step charge with recovery points (Example, CheckpointedExternal).
//
// # Poison and dead letters
//
// A message without a key or with a malformed one, a key first seen with another
// payload, a Permanent handler error, and a message that used up MaxDeliver
// attempts are filed in idem_dead_letters with the reason and terminated on the
// broker; other traffic keeps flowing. If the dead letter cannot be written the
// message is redelivered instead, never dropped. Package deadletter lists them and replays
// one with its original key.
//
// # One engine
//
// Both kinds of handler share the pull loop, the acks, the retries and the dead
// letters; only the step between "delivered" and "settled" differs. Config's zero
// values are the defaults (the Default* constants); Config.RedeliveryHorizon says
// how long one message can keep coming back, which the inbox key lifetime must
// exceed (the worker package checks this at start).
package consumer
