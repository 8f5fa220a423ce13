// Package ops is the operator's read model of an idem installation: what happened
// to one idempotency key, and how far behind each part is. It is what `worker
// inspect KEY` and `worker stats` print and what a web console will show; a team
// that embeds idem in its own service can build the same tooling with it, on its
// own tables.
//
// A Reader reads idem's tables (idem_requests, idem_outbox, idem_inbox,
// idem_dead_letters) in the schema they were migrated to. ops knows nothing of any
// application: the application's own rows for a key are read by an EffectsFunc it
// supplies, and its business totals by a CountsFunc; both run inside ops' snapshot,
// so they agree with idem's rows.
//
//	r, err := ops.New(pool, ops.Config{Schema: "idem", Effects: myEffects, Counts: myCounts})
//	rep, err := r.Inspect(ctx, scope, key) // *KeyReport
//	st, err := r.Stats(ctx)                // *Stats
//	js, err := ops.ReadJetStream(ctx, jsContext, "ORDERS")
//
// It only reads. Inspect and Stats each run in one read-only REPEATABLE READ
// transaction, so what they return is one snapshot: a row that moves from the
// outbox to an inbox while the command runs is shown on one side of the move, never
// both or neither. Every type marshals to JSON for machines (Bytes keeps binary
// columns exact), and the counts are exact: a dashboard polling every few seconds
// should read the worker's metrics instead, or Summary, the cheap part of Stats.
//
// A LagHistory keeps readings of the stream (ReadJetStream) in memory, for what one
// reading cannot tell: each consumer's rate, and whether it keeps up (Trends). The
// worker keeps one (worker.Worker.LagHistory), which the console plots.
package ops
