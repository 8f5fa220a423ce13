//go:build idemfaults

package main

import (
	"context"
	"log/slog"

	"github.com/idemkit/idem/internal/faults"
)

// Built with -tags idemfaults (the chaos suite and the binary tests do), the worker
// arms the fault points named in IDEM_FAULTS.

type faultSet = *faults.Set

func faultsFromEnv() (faultSet, error) { return faults.FromEnv() }

func withFaults(ctx context.Context, fs faultSet, log *slog.Logger) context.Context {
	if fs == nil {
		return ctx
	}
	log.Warn("FAULT INJECTION: this worker arms fault points", "spec", faults.EnvVar)
	if fs.On(faults.SkipInboxClaim) {
		log.Warn("NEGATIVE CONTROL: in-transaction consumers run WITHOUT their inbox claim; effects will double")
	}
	return faults.With(ctx, fs)
}
