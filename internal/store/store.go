// Package store owns idem's tables: every statement that reads, writes or collects
// an idem_* table, one file per table, each qualified for the installation's schema
// once, when the Store is built. The packages that run the statements (the inbox,
// the outbox and its relay, the consumers, the reconciler, the collector, the
// operator's read model) hold no SQL of these tables of their own.
//
// A statement that touches two tables lives with the table it is about: a dead
// letter written while an outbox row is dead-lettered is the dead letters' (every
// writer of idem_dead_letters is in deadletters.go), the proof that a consumer
// settled an outbox row is the inbox's.
package store

import (
	"strings"

	"github.com/idemkit/idem/internal/pgschema"
)

// Store is the SQL of one schema's idem_* tables.
type Store struct {
	Requests    Requests
	Outbox      Outbox
	Published   Published
	Inbox       Inbox
	Attempts    Attempts
	DeadLetters DeadLetters
	Consumers   Consumers
}

// RelayConsumer is the consumer name under which the relay files the dead letters
// of rows the broker refused or that no consumer reads.
const RelayConsumer = "(relay)"

// New returns the statements of schema's tables (default public). The schema must
// be valid (pgschema.Validate).
func New(schema string) *Store {
	q := func(sql string) string { return pgschema.Qualify(schema, sql) }
	return &Store{
		Requests: newRequests(q, schema), Outbox: newOutbox(q, pgschema.Channel(schema, "idem_outbox")), Published: newPublished(q), Inbox: newInbox(q),
		Attempts: newAttempts(q), DeadLetters: newDeadLetters(q), Consumers: newConsumers(q),
	}
}

// CollectIn is the inbox's Collect run against relation (a qualified name): a
// partitioned inbox's ranged partitions are dropped whole (package partition), and
// its default partition, which holds the rows from before the conversion and any
// beyond the last partition, is collected row by row.
func (Inbox) CollectIn(relation string) string {
	return strings.ReplaceAll(sqlInboxCollect, "idem_inbox", relation)
}

// CollectIn is the outbox's Collect run against relation; see Inbox.CollectIn.
func (Outbox) CollectIn(relation string) string {
	return strings.ReplaceAll(sqlOutboxCollect, "idem_outbox", relation)
}
