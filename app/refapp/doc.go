// Package refapp is idem's reference application: the charge and email service
// that cmd/worker runs. It is one user of the library, built only on its public
// API, and the model to read when building your own:
//
//   - its routes (POST /v1/payments, POST /v1/emails) run behind the worker's
//     Idempotency-Key middleware: each request writes its business row and its
//     outbox message in the request's one transaction (ingress.go);
//   - its charge consumer writes ledger_entries inside the inbox transaction, a
//     whole batch per statement (charge.go);
//   - its email consumer is an external effect: SMTP cannot join a transaction, so
//     it runs under a lease and stamps a Message-ID derived from the key, which a
//     mail system dedupes on (email.go);
//   - its own tables (payments, emails, ledger_entries) are created by Migrate,
//     apart from idem's (schema.sql);
//   - Start assembles it with package worker into a running service with health,
//     readiness and metrics endpoints (service.go);
//   - its payment page (Config.PayPage, off by default) is a Pay button on the
//     browser client, which journals the key in the page before it sends
//     (paypage.go).
//
// The HTTP API, the subjects and the table names are a public contract that scripts
// and tests rely on:
//
//	POST /v1/payments  {"account": "acct_1", "amount_cents": 1250}   -> idem.payments.charge
//	POST /v1/emails    {"to": "a@example.com", "subject": "...", "body": "..."} -> idem.emails.send
//
// Both answer 202 with {"key", "payment_id"|"email_id", "status": "accepted"}; the
// message published later carries the request body, unchanged, as its payload, on
// stream IDEM (subjects idem.>).
//
// ledger_entries deliberately has no unique constraint on the key: a double effect
// must show up as a second row, not be hidden by the database.
package refapp
