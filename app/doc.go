// Package app is the root of idem's reference application: the service that
// cmd/worker runs (refapp: payments and emails, their tables, handlers and SMTP
// effect, assembled with worker), its operator console (console), the zero-setup
// connections and private Postgres of its default run (runenv, pgembed), its
// trace logger (tracelog) and what the process tests start it with (refapptest).
//
// It is an application, not a library: it makes no compatibility promise, only
// idem's own modules (cmd, cmd/bench, test) import it, and it is released with
// them at one version (app/vX.Y.Z; docs/RELEASING.md). A module of its own, so that
// its dependencies (go-mail, nats-server, the browser client) stay out of the
// library's graph. Read refapp to see the library used end to end.
package app
