// Package demo is the demo API of cmd/worker: the HTTP ingress that turns a request
// into a business row and an outbox message, once per idempotency key.
//
// It exists to show the producer side of idem end to end, and it is deliberately
// small. Each handler runs inside producer.Middleware's transaction, so the
// sequence
//
//	claim (scope, key) -> INSERT payments -> outbox.Enqueue -> store response -> COMMIT
//
// is atomic: a retry of the same intent replays the first response and writes
// nothing, and a failure anywhere leaves nothing behind for the retry to trip on.
//
// The routes are part of the public contract (DESIGN.md, "HTTP ingress"):
//
//	POST /v1/payments  {"account": "acct_1", "amount_cents": 1250}
//	POST /v1/emails    {"to": "a@example.com", "subject": "...", "body": "..."}
//
// Both answer 202 with {"key", "payment_id"|"email_id", "status": "accepted"}; the
// message published later carries the request body, unchanged, as its payload.
// Health and metrics endpoints belong to cmd/worker, not here.
package demo
