// Package client is the client side of idem: it names each user intent with an
// idempotency key and keeps that key until the service has answered, across retries
// and restarts. It links no database driver; the server side (the Idempotency-Key
// middleware of the ingress) is package producer.
//
// # The key is minted, journaled, then sent
//
// An idempotency key only protects an intent if the client still has it when it needs
// to retry. So the order is fixed:
//
//  1. mint the key on the client (idem.NewKey) when the user acts — never on the
//     server, which would name the intent at the far end of the uncertainty window;
//  2. write it, with the request, to the Journal and fsync, before the first byte
//     goes on the wire;
//  3. send; on a timeout, a dropped connection, a 5xx, a 409 (the first arrival is
//     still running), or a 408, 425 or 429 (come back later), send again with the
//     same key, after a jittered backoff (or the server's Retry-After, if longer);
//  4. record the final response in the Journal (done for 2xx, rejected for another
//     4xx). Until then the intent is pending. A redirect (3xx) is no response: it
//     is never followed, and the intent stays pending (ErrRedirected).
//
// Client implements the loop above (Submit), and Resume re-sends every pending
// intent with its own key after a restart. An intent older than Config.KeyLifetime
// (24h by default) is never re-sent: the service may have forgotten the key, so a
// late retry would be a second effect. It is reported as expired instead, for a
// human to reconcile. The lifetime must be shorter than the service's own (48h for
// request keys and 72h for the consumers' inbox, by default). Within one process the
// age runs on the monotonic clock; across restarts only the journaled wall-clock
// CreatedAt is left, and an intent dated in the future counts as expired (see
// Client.Expired).
//
// # Where the keys live
//
// Journal is a file-backed, append-only log with a checksum on every record: a
// record torn by a crash is detected and dropped without losing the ones before it,
// and an exclusive file lock keeps two processes out of one journal. Prune drops
// old finished intents so a long-lived journal does not grow forever. Directories are
// fsynced as well as files: the ones OpenJournal creates, the journal's own, and the
// one a compaction renames into; a write is not reported durable before they are.
//
// The Client reaches its intents through the small Store interface, which Journal
// implements; an application that already has a local database can keep its
// intents there instead, as long as it keeps the Store contract (above all: Append
// is durable before it returns, because the key goes on the wire right after).
package client
