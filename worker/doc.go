// Package worker is idem's composition root: given an installation (package
// install: a pgx pool, a NATS connection, a stream) and a Config, it runs
// everything a service needs to make its effects happen once per intent, the way
// River's Client runs a job queue.
//
//	inst, err := install.New(pool, nc, install.Config{Stream: install.Stream{Name: "ORDERS", Subjects: []string{"orders.>"}}})
//	w, err := worker.New(inst, worker.Config{
//		Consumers: []consumer.Config{{Name: "shipping", Subject: "orders.created", Handler: ship}},
//		Ingress:   &producer.Config{},
//	})
//	if err := w.Start(ctx); err != nil { ... }   // refuses to start on a broken invariant
//	mux.Handle("POST /orders", w.Ingress().Wrap(createOrder))
//	mux.Handle("GET /readyz", w.ReadyHandler())
//	...
//	w.Stop(shutdownCtx)                          // in-flight work commits and acks; cancelled when shutdownCtx ends
//
// # What it runs
//
// Start applies idem's migrations (or, with NoMigrate, checks that someone did),
// creates the stream when it is absent, and starts, each in its own goroutine:
//
//   - the consumers, in-transaction and external alike (package consumer);
//   - the outbox relay, which publishes committed outbox rows to the stream
//     (package outbox), unless DisableRelay;
//   - the reconciler, beside the relay unless DisableReconciler, which proves
//     every published intent settled by every consumer registered to read it,
//     re-drives what the stream lost, and alerts (as a dead letter) what can no
//     longer be delivered safely;
//   - the collector, which deletes expired inbox keys, request records and published
//     outbox rows in small batches, unless DisableRetention.
//
// Several workers may share one installation and split these roles (two relays, three
// consumer workers); the outbox and the inbox are built for it. A component that
// fails stops the others: Done closes and Err names it, so a process can exit
// non-zero and be restarted by its supervisor. A NATS connection that closes for
// good is such a failure (a closed *nats.Conn never reconnects): connect with
// nats.MaxReconnects(-1) to ride out an outage of any length instead.
//
// # Health
//
// ReadyHandler follows the roles: a worker with an ingress is ready while
// Postgres answers (a broker outage only fills the outbox), one without is ready
// only while the broker and its stream and durable consumers are there too.
// LiveHandler always answers 200, with the broker's state in its body; the metrics
// (idem_nats_connected and the rest) and the log (a line at each disconnect and
// reconnect) show it too.
//
// # Stopping
//
// Stop is soft first: the consumers stop fetching and the work in flight
// finishes (a batch commits and acks, an external effect completes, the relay
// marks its batch). When Stop's context ends before that, the stop turns hard: the
// handlers' contexts are cancelled, a batch rolls back, and its messages are
// redelivered later, as after a crash. Stop returns once every goroutine has.
//
// # The lifetime invariant
//
// A key must be remembered longer than any window in which its intent can still
// arrive, or a late arrival runs the effect a second time. For every consumer of the
// stream registered in the installation (this worker's, by their configuration;
// other processes', by what they registered when they started), the inbox key
// lifetime must exceed the stream's MaxAge, the consumer's redelivery horizon
// (consumer.Config.RedeliveryHorizon) and the clients' re-send horizon
// (Config.ClientResendHorizon); the ingress's request key lifetime must exceed the
// clients' re-send horizon. Start judges this before it creates an absent stream
// (with the configured MaxAge), and against the real stream when it exists, and
// refuses to start, naming the numbers; when the existing stream's MaxAge is the
// cause, the error says to edit the stream, which a corrected configuration cannot
// do. A configured MaxAge that differs from the existing stream's is refused if it
// breaks the invariant and warned about if not. While the worker runs, its stream
// keeper judges again every few seconds, so that an edited stream or a newly
// registered consumer that breaks the invariant makes Ready fail, naming the
// numbers, until it is repaired. Lifetimes reports what was last judged. Storage is
// bounded by retention, never by shortening a lifetime.
//
// # Ingress
//
// With Config.Ingress set, Ingress returns the HTTP Idempotency-Key middleware
// (package producer) of the worker's installation: its outbox accepts only the
// stream's subjects, and wakes this worker's relay directly. The HTTP server itself is the application's: the
// worker offers its handlers (LiveHandler, ReadyHandler) and its metrics
// (RegisterMetrics), and leaves listening, timeouts and routes to the service.
//
// # Observing
//
// Every component reports through one hook shape, idem.Observer, with one of the
// idem.Outcome constants. The worker feeds its Prometheus metrics
// (RegisterMetrics) from it, beside the installation's own Observer.
package worker
