// Package idemwatermill gives Watermill users idem's transactional inbox and outbox:
// a router middleware that runs each handler inside a Postgres transaction that
// also claims the message's idempotency key, and a message.Publisher that writes
// into idem's outbox inside the caller's transaction.
//
// # Why not Watermill's Deduplicator
//
// Watermill ships middleware.Deduplicator. As of v1.5.1 it has two flaws that lose
// or merge effects:
//
//   - It records the key before the handler runs, in a store that knows nothing of
//     the handler's outcome. A handler that fails transiently leaves its key behind;
//     the router nacks, the broker redelivers, the Deduplicator sees the key and acks
//     the redelivery without running the handler. The message is lost.
//   - Its default key is a hash of the payload (Adler-32 of the body). Two legitimate
//     payments of the same amount from the same account are the same bytes, so the
//     second is folded into the first. A content hash names the fields, not the
//     intent. (Its memory store is also per process, so two replicas do not share it.)
//
// # How this package avoids them
//
// [Middleware] takes the key from the message metadata "Idempotency-Key"
// ([idem.HeaderKey]), a key minted by the client when the user acted; never a hash
// of the payload. A message without a key is rejected with a permanent error.
//
// For each message it begins a transaction and claims (consumer, key, message) in
// idem_inbox together with the payload (dedupe.Inbox.Claim, the same claim idem's own
// JetStream consumer makes: a look-up that writes nothing), and acts on the verdict. The message is the topic the
// router subscribed (a NATS subject: subscribe literal subjects, not wildcards, for
// two messages of one intent to count as two) and the Idem-Message name, if any. (A
// copy whose Idem-Replay-For names other consumers is acked without a claim.) The
// verdicts:
//
//   - Duplicate (key already claimed with the same payload): the handler is not
//     called; the message is acked and produces no messages.
//   - Mismatch (key already claimed with another payload): a producer bug. A
//     permanent error wrapping [ErrFingerprintMismatch]; nothing is merged.
//   - Fresh: the handler runs with the transaction in the message context
//     ([TxFromContext]). If it fails the transaction is rolled back, claim and all,
//     so the redelivery runs the handler again. If it succeeds the delivery's one
//     inbox row is written (dedupe.Inbox.Settle) and commits together with the
//     handler's own writes: there is no moment at which one exists without the
//     other. Of two copies handled at the same moment, both may run the handler;
//     only one commits, the other's settlement fails and rolls back its writes, and
//     the middleware claims it again and folds it as a duplicate.
//
// The middleware takes the service's *install.Installation, which names the pool,
// the schema of idem's tables and the stream: it needs no NATS connection of its
// own, since it only reads and writes the tables (install.New accepts a nil one).
// [Config].KeyLifetime must outlast every window in which the broker can deliver
// the message again; check it at start-up with dedupe.Lifetimes.Check (package
// worker does so for idem's own consumers, but your Watermill broker is not one of
// them).
//
// # Wiring
//
// Permanent errors (missing or malformed key, fingerprint mismatch, a message the
// outbox refuses, or a handler error wrapped with [Permanent]) can never succeed on redelivery: combine the
// middleware with middleware.PoisonQueueWithFilter and [IsPermanent], or every
// redelivery fails again. Retries go outside the idem middleware, so every attempt
// gets a fresh transaction (a failed statement aborts a Postgres transaction):
//
//	poison, _ := middleware.PoisonQueueWithFilter(poisonPub, "poison", idemwatermill.IsPermanent)
//	router.AddMiddleware(
//		poison, // outermost: files permanent errors with their reason, then acks
//		middleware.Retry{
//			MaxRetries:      3,
//			InitialInterval: 100 * time.Millisecond,
//			Multiplier:      2,
//			ShouldRetry:     func(p middleware.RetryParams) bool { return !idemwatermill.IsPermanent(p.Err) },
//		}.Middleware,
//		idemwatermill.Middleware(inst, idemwatermill.Config{Consumer: "orders"}), // innermost
//	)
//
// A transient error that outlives the retries is returned to the router, which nacks
// the message; the broker redelivers it and it runs again. Nothing is dropped.
//
// # Messages produced by a handler
//
// By default, messages a handler returns are published by the router after the
// middleware has committed, outside the transaction. If that publish fails the
// router nacks, the redelivery is a duplicate, and the returned messages are not
// produced again: they are lost. Set [Config].OutboxSubject and the middleware
// writes them into the installation's outbox inside the transaction instead — they
// commit with the claim and the business rows or not at all, the router gets none,
// and idem's relay publishes them to JetStream. A returned message without a key gets [DerivedKey] (consumer, incoming
// key, position) in the incoming scope, so downstream consumers can fold them too.
// For several subjects, write from inside the handler with [NewOutboxPublisher] on
// the transaction from [TxFromContext].
//
// # The outbox publisher
//
// [OutboxPublisher] maps a Watermill message onto an idem.Message and writes it
// through an *outbox.Outbox, so its installation's schema and stream subjects
// apply: the
// topic is the JetStream subject, any literal subject under the stream's subjects
// (for example "orders.created" on a stream of "orders.>"; the topology is yours);
// metadata "Idempotency-Key" is the key (required: a Watermill message UUID is not
// an idempotency key unless you set it as one); metadata "Idempotency-Scope", when
// set, is joined to the key with idem.ScopedKey; the payload is the payload;
// metadata "Nats-Msg-Id" is dropped (the relay derives the Msg-Id from subject and
// key, and one copied from an incoming message would fold the new message into the
// old one at the broker); all other metadata become headers.
//
// # Delivery proof
//
// idem's reconciler completes a published intent once every consumer registered
// in the installation that reads its subject has settled its key. The middleware
// does not register itself (it does not know the subjects its router subscribes
// to), and idem has no public call to register it, so the reconciler does not wait
// for it: an intent read by an idem consumer as well is completed once that one has
// settled it, and one only Watermill handlers read is reported unrouted, then
// dead-lettered past its horizon. List the subjects only Watermill handlers read in
// worker.ReconcileConfig.Trusted: their intents are then complete once published.
package idemwatermill
