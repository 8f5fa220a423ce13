package main

// The e2e-ordered scenario: what ordering by key costs on the relay+consumer path.
// N outbox rows over orderedKeys ordering keys are pre-filled (untimed); then a
// relay and the consumers start, and the time until every effect has committed is
// measured. Rows: unordered (one subject, the default consumer), and ordered over
// each of orderedPartitions (partition subjects, RelayConfig.OrderedSubjects,
// consumer.Partitioned). Each row runs in a fresh environment. The ordered rows
// verify every key was applied in enqueue order; the unordered row reports how
// many messages it applied out of their key's order (nothing promised there).

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/internal/app/refapp"
)

const scE2EOrdered = "e2e-ordered"

// orderedPartitions are the partition counts measured; orderedKeys the ordering
// keys the messages are spread over (an order id each).
var orderedPartitions = []int{4, 16}

const (
	orderedKeys    = 1000
	orderedSubject = "idem.bench.ordered"
	orderedPrefill = 1000 // rows per pre-fill transaction
)

func runE2EOrdered(ctx context.Context, newEnv envFactory, opts Options, log *slog.Logger) ([]Result, error) {
	variants := []int{0} // 0: unordered
	variants = append(variants, orderedPartitions...)
	var out []Result
	for _, parts := range variants {
		row := "e2e-ordered, unordered"
		if parts > 0 {
			row = fmt.Sprintf("e2e-ordered, ordered, %d partitions", parts)
		}
		load, _ := os.ReadFile("/proc/loadavg")
		fmt.Fprintf(os.Stderr, "[%s] %s: loadavg before: %s", scE2EOrdered, row, load)
		res, err := withEnv(ctx, labelled(newEnv, scE2EOrdered), func(env *Env) (Result, error) {
			return runOrderedVariant(ctx, env, opts, log, parts, row)
		})
		if err != nil {
			return nil, fmt.Errorf("%s: %s: %w", scE2EOrdered, row, err)
		}
		res.Notes = append(res.Notes, "loadavg before: "+string(load[:len(load)-1]))
		out = append(out, res)
	}
	return out, nil
}

// orderedEffect writes one bench_ordered row per delivery, in one statement per
// batch; the serial id is the order effects were applied in.
type orderedEffect struct{ applied *counter }

func (e orderedEffect) HandleBatch(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error) {
	keys := make([]int32, len(ds))
	seqs := make([]int32, len(ds))
	for i, d := range ds {
		if len(d.Payload) != 8 {
			return nil, consumer.Permanent(fmt.Errorf("payload of %d bytes", len(d.Payload)))
		}
		keys[i], seqs[i] = int32(binary.BigEndian.Uint32(d.Payload)), int32(binary.BigEndian.Uint32(d.Payload[4:]))
	}
	if _, err := tx.Exec(ctx, `INSERT INTO bench_ordered (k, s) SELECT * FROM unnest($1::int[], $2::int[])`, keys, seqs); err != nil {
		return nil, err
	}
	return make([][]byte, len(ds)), nil
}

func runOrderedVariant(ctx context.Context, env *Env, opts Options, log *slog.Logger, parts int, row string) (Result, error) {
	n := opts.N
	if _, err := env.Pool.Exec(ctx, `CREATE TABLE bench_ordered (id bigserial PRIMARY KEY, k int NOT NULL, s int NOT NULL)`); err != nil {
		return Result{}, err
	}
	// Pre-fill: message i is the (i/orderedKeys+1)-th of key i%orderedKeys, so
	// every key's messages are spread over the whole outbox.
	for lo := 0; lo < n; lo += orderedPrefill {
		msgs := make([]idem.Message, 0, orderedPrefill)
		for i := lo; i < min(lo+orderedPrefill, n); i++ {
			k, s := i%orderedKeys, i/orderedKeys+1
			subject := orderedSubject
			if parts > 0 {
				subject = outbox.Partition(orderedSubject, fmt.Sprint(k), parts)
			}
			p := binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint32(nil, uint32(k)), uint32(s))
			msgs = append(msgs, idem.Message{Key: fmt.Sprintf("o-%d-%d", k, s), Subject: subject, Payload: p})
		}
		if err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error { return env.Outbox.Enqueue(ctx, tx, msgs...) }); err != nil {
			return Result{}, fmt.Errorf("pre-fill: %w", err)
		}
	}

	applied := newCounter(n)
	var failed atomic.Int64
	observe := func(e idem.Event) {
		switch e.Outcome {
		case idem.OutcomeProcessed:
			applied.Add(e.Count)
		case idem.OutcomeFailed:
			failed.Add(int64(e.Count))
		}
	}
	rc := outbox.RelayConfig{Stream: refapp.StreamName, BatchSize: opts.RelayBatch, Logger: log}
	base := consumer.Config{Name: "bench-ordered", Stream: refapp.StreamName, Subject: orderedSubject,
		BatchHandler: orderedEffect{applied}, Observer: observe, Logger: log}
	cfgs := []consumer.Config{base}
	if parts > 0 {
		rc.OrderedSubjects = []string{orderedSubject + ".*"}
		var err error
		if cfgs, err = consumer.Partitioned(base, parts); err != nil {
			return Result{}, err
		}
	}
	relay, err := outbox.NewRelay(env.Pool, env.JS, rc)
	if err != nil {
		return Result{}, err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go progress(runCtx, scE2EOrdered, "applied", n, applied.Load)
	meter, err := env.StartMeter(ctx)
	if err != nil {
		return Result{}, err
	}
	done := make(chan error, len(cfgs)+1)
	for _, cfg := range cfgs {
		c, err := consumer.New(env.Pool, env.JS, cfg)
		if err != nil {
			return Result{}, err
		}
		go func() { done <- c.Run(runCtx) }()
	}
	go func() { done <- relay.Run(runCtx) }()
	waitErr := applied.wait(ctx, opts.Timeout, "applied")
	meas, merr := meter.Stop(ctx)
	cancel()
	for range len(cfgs) + 1 {
		if err := <-done; err != nil {
			return Result{}, err
		}
	}
	if waitErr != nil {
		return Result{}, waitErr
	}
	if merr != nil {
		return Result{}, merr
	}

	res := Result{Scenario: scE2EOrdered, Row: row, N: n, Messages: n,
		Config: map[string]any{"partitions": parts, "ordering_keys": orderedKeys, "relay_batch": opts.RelayBatch}}
	res.setMeasurement(meas, n)
	// Verify: each message applied once; and how many were applied after a later
	// message of their key.
	var rows, distinct, inversions int
	err = env.Pool.QueryRow(ctx, `
SELECT count(*), count(DISTINCT (k, s)),
       count(*) FILTER (WHERE s < prev_max)
FROM (SELECT k, s, max(s) OVER (PARTITION BY k ORDER BY id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_max FROM bench_ordered) t`).
		Scan(&rows, &distinct, &inversions)
	if err != nil {
		return Result{}, fmt.Errorf("verify: %w", err)
	}
	switch {
	case rows != n || distinct != n:
		return Result{}, fmt.Errorf("VERIFY FAILED: %d effects, %d distinct, want %d", rows, distinct, n)
	case parts > 0 && inversions > 0:
		return Result{}, fmt.Errorf("VERIFY FAILED: %d messages applied after a later message of their key", inversions)
	}
	res.Verified = fmt.Sprintf("%d effects, once each; %d applied after a later message of their key", n, inversions)
	if f := failed.Load(); f > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("%d failed attempts retried", f))
	}
	fmt.Fprintf(os.Stderr, "[%s] %s: %.0f/s (%s)\n", scE2EOrdered, row, res.Rate, res.Verified)
	return res, nil
}
