// Package console is an operator console in the browser for an idem installation:
// server-rendered pages over the same read model as `worker inspect` and `worker
// stats` (package ops) and the same dead-letter operations as `worker
// dead-letters` (deadletter.Queue). It holds no SQL of its own.
//
//	h, err := console.New(console.Config{
//		Ops: reader, DeadLetters: dls, JetStream: js, Stream: "ORDERS",
//		Token: os.Getenv("CONSOLE_TOKEN"),
//	})
//	mux.Handle("/console", h)
//	mux.Handle("/console/", h)
//
// Pages, under Config.Prefix (default "/console"):
//
//	/console                overview: messages/s, outbox backlog, each consumer's lag and rate (plotted over
//	                        the last 15 minutes from Config.Lag), dead letters, folds, reconcile status;
//	                        it refreshes by itself, and the exact table counts on reload
//	/console/dead-letters   dead letters with filters; replay one or many (dry run first, then confirm)
//	/console/inspect        one key's whole life, the application's rows included (ops.Config.Effects)
//	/console/streams        the stream and its consumers: config, pending, ack-pending, redeliveries
//
// Safety: serve it on an internal listener (the reference worker serves it where
// /metrics is, loopback by default). Every state-changing request is a POST
// carrying a CSRF token bound to a per-browser cookie with a per-process secret
// (HMAC); a POST without it, or from another origin, gets 403. With Token or
// BasicUser set every request must authenticate. Without either, the console
// answers only requests addressed to localhost, 127.0.0.1 or [::1] and wants an
// Origin on every POST, so a web page that rebinds its name to the loopback
// address can neither read it nor act through it. All values are rendered through
// html/template, so keys and payloads are escaped. Templates and the one small
// script are embedded: no build step, and the Content-Security-Policy allows
// nothing from outside the console.
package console
