// Package parts is what idem's own packages share through a public value without
// the public value exporting it (River's baseservice.Archetype): an installation's
// connections, schema, stream and observers, the SQL of its tables and the waker
// of its relays. Package install registers, from its init, the one function that
// reads an Installation's parts; the public components ask here, and the internal
// services (the relays, the reconciler) take the value itself, so that no import
// climbs from the plumbing back up to package install. (A worker's lag history is
// read the same way, through ops.LagOf.)
package parts

import (
	"context"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/store"
	"github.com/idemkit/idem/internal/wake"
)

// Installation is what an *install.Installation shares with idem's packages.
type Installation struct {
	Pool *pgxpool.Pool
	// JS is nil for an installation without a broker.
	JS jetstream.JetStream
	// Schema is the schema of the idem_* tables, defaulted.
	Schema string
	// Stream is the name of the installation's stream.
	Stream   string
	Logger   *slog.Logger
	Tracer   trace.TracerProvider
	Observer idem.Observer
	Store    *store.Store
	Waker    *wake.Waker
	// Identify is install.Installation.Identify.
	Identify func(ctx context.Context) (string, error)
	// SchemaVersions is migrations.Versions of the installation's schema: the
	// newest version applied, and the newest this build knows.
	SchemaVersions func(ctx context.Context) (applied, known int, err error)
}

// installationOf is set once by package install's init and read-only afterwards.
var installationOf func(any) Installation

// RegisterInstallation is called by package install's init.
func RegisterInstallation(f func(any) Installation) { installationOf = f }

// Of returns the parts of inst, an *install.Installation.
func Of(inst any) Installation { return installationOf(inst) }
