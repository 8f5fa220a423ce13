// Package deadletter is the operator's side of idem_dead_letters: listing,
// inspecting and replaying the messages that can never succeed as they are.
//
// A consumer files a dead letter when its handler returns a permanent error, a
// message exceeds its deliveries, or a message is malformed (no key, a payload it
// cannot decode); the relay files one, under outbox.RelayConsumer, for a message
// the broker refuses. Nothing is retried for ever and nothing is dropped: the row
// keeps the message, its headers and the reason.
//
// A replay (Queue.Replay, Queue.ReplayID) puts a dead letter back through the
// outbox with its original key, once the cause is fixed, for the consumer that
// filed it alone. It is refused, unless forced, when the consumer's inbox might
// have forgotten the key by the time the replay arrives: the effect could then
// run twice.
//
//	q := deadletter.New(inst)
//	rep, err := q.Replay(ctx, deadletter.Filter{Consumer: "billing", ReasonPrefix: "permanent"}, deadletter.ReplayOptions{DryRun: true})
//
// The reference worker's `worker deadletters` commands and its console are built
// on this package.
package deadletter
