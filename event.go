package idem

import "time"

// Components named in Event.Component.
const (
	ComponentIngress    = "ingress"
	ComponentRelay      = "relay"
	ComponentConsumer   = "consumer"
	ComponentCollector  = "collector"
	ComponentReconciler = "reconciler"
)

// Event is one thing a component did: a request answered, a relay batch published, a
// batch of deliveries settled, expired rows deleted. Every component reports through
// the same shape, so one Observer (metrics, logs, a test) can listen to all of them
// and observers chain without adapters.
type Event struct {
	// Component is one of the Component* constants.
	Component string
	// Name says which one: the consumer's name, the collector's table; empty for
	// the ingress and the relay.
	Name string
	// Outcome is what happened: one of the Outcome constants the component's
	// group lists.
	Outcome Outcome
	// Count is how many requests, messages or rows the event covers (at least 1).
	Count int
	// Duration is how long the step took, where the component times it (a relay
	// batch, a request, a consumer batch's transaction); zero otherwise.
	Duration time.Duration
	// HandlerDuration is the part of a consumer batch's Duration spent in the
	// application's handlers (OutcomeProcessed); zero otherwise.
	HandlerDuration time.Duration
	// EndToEnd holds, for each message a consumer batch processed
	// (OutcomeProcessed), the time from its outbox row's creation (the
	// relay's HeaderEnqueuedAt, by the database's clock) to the batch's commit (by
	// this process's clock). Messages without the header are left out.
	EndToEnd []time.Duration
}

// Outcome is what an Event reports happened. Outcomes are stable strings, fit
// for metric labels; one outcome may be reported by several components (Failed,
// DeadLettered, Busy), and Event.Component tells them apart.
type Outcome string

// Outcomes of the ingress (ComponentIngress): one event per state-changing
// request.
const (
	// OutcomeNew: the key was claimed, the handler ran and its response was stored.
	OutcomeNew Outcome = "new"
	// OutcomeReplayed: the key had a stored response, which was sent again.
	OutcomeReplayed Outcome = "replayed"
	// OutcomeConflict: the first arrival was still running when the ingress's
	// Wait ran out (409).
	OutcomeConflict Outcome = "conflict"
	// OutcomeMismatch: the key was used before with a different request (422).
	OutcomeMismatch Outcome = "mismatch"
	// OutcomeRejected: the request was refused before claiming the key: missing or
	// malformed key or scope, unreadable or oversize body (400, 413).
	OutcomeRejected Outcome = "rejected"
	// OutcomeUnavailable: the database could not be reached or failed (503/500);
	// nothing was claimed.
	OutcomeUnavailable Outcome = "unavailable"
)

// Outcomes of the consumers (ComponentConsumer, Name the consumer's): one event
// per batch and outcome.
const (
	// OutcomeProcessed: the effect ran (or, for an external effect, completed)
	// and the message was acked.
	OutcomeProcessed Outcome = "processed"
	// OutcomeDuplicate: the key was done already; the message was acked, no effect.
	OutcomeDuplicate Outcome = "duplicate"
	// OutcomeAbandoned: a test fault point abandoned the work as if the worker had
	// died there.
	OutcomeAbandoned Outcome = "abandoned"
	// OutcomeSkipped: a copy meant for other consumers (a dead-letter replay or a
	// re-drive, HeaderReplayFor); acked without an effect.
	OutcomeSkipped Outcome = "skipped"
)

// Outcomes several components report.
const (
	// OutcomeFailed: the ingress's handler answered 5xx or panicked (everything
	// rolled back, so a retry executes again); a consumer's attempt failed and the
	// message will be redelivered; a relay's publish failed and the row is retried
	// after a backoff.
	OutcomeFailed Outcome = "failed"
	// OutcomeDeadLettered: a consumer filed the message in idem_dead_letters with
	// its reason and terminated it; the relay filed a row the broker can never
	// take, or that failed too often, under its own name (outbox.RelayConsumer).
	OutcomeDeadLettered Outcome = "dead_lettered"
	// OutcomeBusy: the ingress had its maximum of requests in flight (503,
	// nothing claimed); an external effect's key was leased by another worker, and
	// the delivery was handed back to be retried after that lease would end.
	OutcomeBusy Outcome = "busy"
)

// Outcomes of the relay (ComponentRelay), one event per batch and outcome, with
// the batch's duration, and of the collector (ComponentCollector, Name the
// table).
const (
	// OutcomePublished: rows the stream acknowledged and the relay marked published.
	OutcomePublished Outcome = "published"
	// OutcomeDeleted: expired rows the collector deleted.
	OutcomeDeleted Outcome = "deleted"
	// OutcomeDropped: a partition the collector dropped whole because every row in
	// it had expired (Count is 1 partition).
	OutcomeDropped Outcome = "dropped"
)

// Outcomes of the reconciler (ComponentReconciler), one event per pass and
// outcome that occurred.
const (
	// OutcomeCompleted: rows proven settled by every consumer that should see them.
	OutcomeCompleted Outcome = "completed"
	// OutcomeLagging: rows still in the stream, not yet settled by some consumer.
	OutcomeLagging Outcome = "lagging"
	// OutcomeUnrouted: rows no registered consumer reads.
	OutcomeUnrouted Outcome = "unrouted"
	// OutcomeRedriven: rows the stream lost, handed back to the relay under a new
	// Msg-Id generation.
	OutcomeRedriven Outcome = "redriven"
	// OutcomeAlerted: rows past every horizon, given up on and dead-lettered.
	OutcomeAlerted Outcome = "alerted"
)

// Observer receives Events. It is called synchronously on the component's hot path,
// so it must be fast and safe for concurrent use.
type Observer func(Event)

// Observe calls o with e if o is not nil.
func (o Observer) Observe(e Event) {
	if o != nil {
		o(e)
	}
}
