// Command bench measures idem against baselines in one run on one machine.
//
//	go run ./cmd/bench                      # every scenario, N=20000
//	go run ./cmd/bench -scenarios idem-consumer,naive -n 50000
//	go run ./cmd/bench -h                   # the scenarios and the flags
//
// Each scenario runs in a child process of this same binary (so its peak RSS is
// its own), each phase against a fresh database (the test kit's throwaway
// database, migrated with idem's tables and the reference application's, dropped
// afterwards unless -keep) and a fresh embedded JetStream server with the
// reference application's stream. Scenarios run one after another; the parent
// prints a table on stdout and writes every number as JSON (-json). Progress goes
// to stderr.
//
// The scenarios are in internal/scenario, one file each, registered in
// scenario.All; the measurements in internal/measure; the rows, ratios, targets,
// table and JSON in internal/report; a phase's environment in internal/benchenv.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	level := slog.LevelError
	if cfg.Verbose {
		level = slog.LevelWarn
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	if cfg.child != "" {
		err = runChild(ctx, cfg, log)
	} else {
		err = runParent(ctx, cfg, log)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}
