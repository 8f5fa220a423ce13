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
	// Outcome is what happened, one of the component's Outcome constants
	// (producer.OutcomeNew, consumer.OutcomeProcessed, outbox.OutcomePublished, ...).
	Outcome string
	// Count is how many requests, messages or rows the event covers (at least 1).
	Count int
	// Duration is how long the step took, where the component times it (a relay
	// batch, a request, a consumer batch's transaction); zero otherwise.
	Duration time.Duration
	// HandlerDuration is the part of a consumer batch's Duration spent in the
	// application's handlers (consumer.OutcomeProcessed); zero otherwise.
	HandlerDuration time.Duration
	// EndToEnd holds, for each message a consumer batch processed
	// (consumer.OutcomeProcessed), the time from its outbox row's creation (the
	// relay's HeaderEnqueuedAt, by the database's clock) to the batch's commit (by
	// this process's clock). Messages without the header are left out.
	EndToEnd []time.Duration
}

// Observer receives Events. It is called synchronously on the component's hot path,
// so it must be fast and safe for concurrent use.
type Observer func(Event)

// Observers returns an Observer that calls each non-nil observer in order, or nil
// when there is none.
func Observers(obs ...Observer) Observer {
	var live []Observer
	for _, o := range obs {
		if o != nil {
			live = append(live, o)
		}
	}
	switch len(live) {
	case 0:
		return nil
	case 1:
		return live[0]
	}
	return func(e Event) {
		for _, o := range live {
			o(e)
		}
	}
}

// Observe calls o with e if o is not nil.
func (o Observer) Observe(e Event) {
	if o != nil {
		o(e)
	}
}
