// Package producer is where an intent enters idem: the client that names it and the
// HTTP ingress that receives it.
//
// # Client side: the key is minted, journaled, then sent
//
// An idempotency key only protects an intent if the client still has it when it needs
// to retry. So the order is fixed:
//
//  1. mint the key on the client (idem.NewKey) when the user acts — never on the
//     server, which would name the intent at the far end of the uncertainty window;
//  2. write it, with the request, to the Journal and fsync, before the first byte
//     goes on the wire;
//  3. send; on a timeout, a dropped connection, a 5xx or a 409 (the first arrival is
//     still running), send again with the same key, after a jittered backoff (or
//     the server's Retry-After, if longer);
//  4. record the final response in the Journal (done for 2xx, rejected for another
//     4xx). Until then the intent is pending.
//
// Journal is a file-backed, append-only log with a checksum on every record: a
// record torn by a crash is detected and dropped without losing the ones before it,
// and an exclusive file lock keeps two processes out of one journal. Client
// implements the loop above (Submit), and Resume re-sends every pending intent with
// its own key after a restart. An intent older than the server's key lifetime is
// never re-sent (the server may have forgotten the key, so a late retry would be a
// second effect); it is reported as expired instead.
//
// Two fault switches on Request exist for demonstrations. DropFirstResponse discards
// the first response as if the network had lost it: the retry carries the same key
// and the server replays, so the effect happens once. ForgetKey also wipes the key
// before the retry and mints a new one, which is what a client that keeps its key
// only in memory does after a crash: the server sees two intents and the effect
// happens twice. It is the negative control that shows what the journal is for.
//
// # Server side: the Idempotency-Key middleware
//
// The same package holds the HTTP middleware of the ingress. For a state-changing
// request it opens a Postgres transaction and claims (scope, key) in idem_requests;
// it hands the handler that pgx.Tx through the request context, so the business rows
// and the outbox row are written in the same transaction as the claim; it stores the
// handler's response in that transaction before committing. A duplicate gets the
// first status and body again with Idempotent-Replayed: true; a missing key is a
// 400, the same key with a different body a 422, and the same key while the first
// is still running a 409 once the wait times out.
package producer
