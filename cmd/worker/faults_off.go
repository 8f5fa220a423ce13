//go:build !idemfaults

package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/idemkit/idem/internal/faults"
)

// The shipped worker has no fault injection: the fault points exist in the code,
// but nothing can arm them, so no environment variable can, say, switch the inbox
// claim off in production. Tests build the worker with -tags idemfaults.

type faultSet = *faults.Set

func faultsFromEnv() (faultSet, error) {
	if v := os.Getenv(faults.EnvVar); v != "" {
		return nil, fmt.Errorf("%s is set (%q), but this worker was built without fault injection; build it with -tags idemfaults to use fault points", faults.EnvVar, v)
	}
	return nil, nil
}

func withFaults(ctx context.Context, _ faultSet, _ *slog.Logger) context.Context { return ctx }
