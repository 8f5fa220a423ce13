// Package install is what an installation of idem shares: the Postgres pool and
// schema that hold its tables, the JetStream connection and stream it publishes to
// and consumes from, its identity, and its logger, tracer and observer. Every
// component takes one Installation (worker.New, and through it the ingress, the
// relay, the consumers, the reconciler and the collector), so none of them has a
// Schema, a Stream or a Logger of its own to disagree about.
//
// # What an installation is
//
// An installation is a database, a schema in it and a stream. Two services on one
// database keep their tables apart with two schemas (Config.Schema); two services
// on one NATS account keep their messages apart with two streams (Config.Stream).
// The tables come from package migrations, which worker.Worker.Start applies
// unless told not to.
//
// An installation is named by a random token its first migration stores in the
// database (the idem_installation table), not by where the database lives: a
// rename, pg_upgrade or dump and restore keeps it. Each durable JetStream consumer
// records the token of the installation that bound it, and the epoch of that
// binding; a consumer refuses a durable of another token
// (consumer.ErrForeignDurable), and one that a physical copy of its database has
// bound since (consumer.ErrForkedDatabase), because two inboxes on one durable
// split its messages and each runs the effects of its share. docs/OPERATIONS.md,
// "Copies and moves", says what to do with a restored copy or a moved database.
//
// # Building one
//
// New checks the configuration and touches neither store. A process with no
// broker (a tool that only reads and writes the tables: dead letters, the
// consumer registry, a producer's outbox) passes a nil *nats.Conn; the components
// that publish or consume refuse such an installation. EnsureStream creates the stream when it is
// absent; the worker calls it at start.
//
// Observing returns an installation that shares the parts and tells every event to
// another observer as well: how the worker adds its metrics.
package install
