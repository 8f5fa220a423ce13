// Package producer is where an intent enters a producing service: the HTTP
// Idempotency-Key middleware of its ingress. The client side (minting the key,
// journaling it before the first send, retrying with it) is package client.
//
// For a state-changing request the middleware opens one Postgres transaction:
//
//	BEGIN
//	  claim (scope, key) in idem_requests        -- a duplicate waits here, then replays
//	  handler(ctx)                               -- business rows and Intent.Enqueue, in the tx
//	  store the handler's response in the claim
//	COMMIT
//	write the response
//
// BEGIN goes to Postgres in one round trip with the claim, and COMMIT in one with
// the outbox rows and the stored response, so the middleware adds two round trips
// to the handler's own. The claim, the effect, the outbox message and the
// remembered response commit together, so a crash anywhere before COMMIT leaves no trace and the client's
// retry executes again, while a crash after it leaves the first response to be
// replayed. The handler gets the transaction and the intent's name from
// IntentFrom(ctx); Intent.Enqueue writes a message stamped with the scoped key.
//
// What a client sees: a duplicate gets the first status and body again with
// Idempotent-Replayed: true; a missing or malformed key is 400; the same key with a
// different method, path or body is 422, and so is a UUIDv7 key older than the
// service remembers keys (Config.KeyLifetime) that has no live record; the same
// key while the first request is still running is 409 with Retry-After once
// Config.Wait runs out; an oversize body is 413 before anything is claimed; a 5xx
// (or 408, 425, 429) from the handler rolls everything back and is never stored,
// so the retry runs again.
//
// # Serving
//
// Serve the wrapped handlers through GuardListener. Go's net/http executes a
// request hidden in the body of one that carries both Content-Length and
// Transfer-Encoding, and hides that from every handler, so the middleware cannot
// refuse it; the listener can.
//
// # Scope
//
// Keys are unique per scope (a tenant or principal), never across scopes: the
// middleware carries the scoped key (idem.ScopedKey) past the ingress, so two
// tenants that pick the same key stay two intents everywhere. Config.Scope derives
// the scope from the request.
package producer
