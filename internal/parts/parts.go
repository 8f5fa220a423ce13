// Package parts is what idem's own packages share through a public value without
// the public value exporting it (River's baseservice.Archetype): the SQL of an
// installation's tables and the waker of its relays. Package install registers,
// from its init, the one function that reads an Installation's parts; the
// components ask here. (A worker's lag history is read the same way, through
// ops.LagOf.)
package parts

import (
	"github.com/idemkit/idem/internal/store"
	"github.com/idemkit/idem/internal/wake"
)

// Installation is what an *install.Installation shares with idem's packages.
type Installation struct {
	Store *store.Store
	Waker *wake.Waker
}

// installationOf is set once by package install's init and read-only afterwards.
var installationOf func(any) Installation

// RegisterInstallation is called by package install's init.
func RegisterInstallation(f func(any) Installation) { installationOf = f }

// Of returns the parts of inst, an *install.Installation.
func Of(inst any) Installation { return installationOf(inst) }
