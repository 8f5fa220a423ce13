package scenario

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"strings"
	"sync/atomic"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/report"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
)

// e2eOrdered measures what ordering by key costs on the relay+consumer path. N
// outbox rows over orderedKeys ordering keys are pre-filled (untimed); then a
// relay and the consumers start, and the time until every effect has committed is
// measured. Rows: unordered (one subject, the default consumer), and ordered over
// each of orderedPartitions (partition subjects, the relay's ordered subjects,
// partitioned consumers). Each row runs in a fresh environment. The ordered rows
// verify every key was applied in enqueue order; the unordered row reports how
// many messages it applied out of their key's order (nothing promised there).
type e2eOrdered struct{}

func (e2eOrdered) Name() string { return "e2e-ordered" }

func (e2eOrdered) Summary() string {
	return "relay + consumers over N pre-filled rows of 1000 ordering keys: unordered, and ordered over 4 and 16 partitions"
}

// orderedPartitions are the partition counts measured (0: unordered).
var orderedPartitions = []int{0, 4, 16}

const (
	// orderedKeys are the ordering keys the messages are spread over (an order
	// id each).
	orderedKeys    = 1000
	orderedSubject = "idem.bench.ordered"
	orderedPrefill = 1000 // rows per pre-fill transaction
)

func orderedRow(parts int) string {
	if parts == 0 {
		return "e2e-ordered, unordered"
	}
	return fmt.Sprintf("e2e-ordered, ordered, %d partitions", parts)
}

func (s e2eOrdered) Rows(Options) []string {
	var out []string
	for _, p := range orderedPartitions {
		out = append(out, orderedRow(p))
	}
	return out
}

func (s e2eOrdered) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	var out []report.Result
	for _, parts := range orderedPartitions {
		row := orderedRow(parts)
		load, _ := os.ReadFile("/proc/loadavg")
		fmt.Fprintf(os.Stderr, "[%s] %s: loadavg before: %s", s.Name(), row, load)
		res, err := withEnv(ctx, h, s.Name(), func(env *benchenv.Env) (report.Result, error) {
			return s.variant(ctx, env, h, parts, row)
		})
		if err != nil {
			return nil, fmt.Errorf("%s: %s: %w", s.Name(), row, err)
		}
		res.Notes = append(res.Notes, "loadavg before: "+strings.TrimSuffix(string(load), "\n"))
		out = append(out, res)
	}
	return out, nil
}

// orderedEffect writes one bench_ordered row per delivery, in one statement per
// batch; the serial id is the order effects were applied in.
type orderedEffect struct{}

func (orderedEffect) HandleBatch(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error) {
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

// orderedMessage is message i: the (i/orderedKeys+1)-th of key i%orderedKeys, so
// every key's messages are spread over the whole outbox. Its payload is the key
// and the sequence, 4 bytes each.
func orderedMessage(i, parts int) idem.Message {
	k, s := i%orderedKeys, i/orderedKeys+1
	subject := orderedSubject
	if parts > 0 {
		subject = outbox.Partition(orderedSubject, fmt.Sprint(k), parts)
	}
	p := binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint32(nil, uint32(k)), uint32(s))
	return idem.Message{Key: fmt.Sprintf("o-%d-%d", k, s), Subject: subject, Payload: p}
}

func (s e2eOrdered) variant(ctx context.Context, env *benchenv.Env, h *Harness, parts int, row string) (report.Result, error) {
	n := h.Opts.N
	if _, err := env.Pool.Exec(ctx, `CREATE TABLE bench_ordered (id bigserial PRIMARY KEY, k int NOT NULL, s int NOT NULL)`); err != nil {
		return report.Result{}, err
	}
	for lo := 0; lo < n; lo += orderedPrefill {
		msgs := make([]idem.Message, 0, orderedPrefill)
		for i := lo; i < min(lo+orderedPrefill, n); i++ {
			msgs = append(msgs, orderedMessage(i, parts))
		}
		if err := pgx.BeginFunc(ctx, env.Pool, func(tx pgx.Tx) error { return env.Outbox.Enqueue(ctx, tx, msgs...) }); err != nil {
			return report.Result{}, fmt.Errorf("pre-fill: %w", err)
		}
	}

	applied := newCounter(n)
	var failed atomic.Int64
	rs := relaySpec{BatchSize: h.Opts.RelayBatch}
	cs := consumerSpec{Name: "bench-ordered", Subject: orderedSubject, Handler: orderedEffect{}, Partitions: parts,
		Observe: func(k eventKind, count int) {
			switch k {
			case evProcessed:
				applied.Add(count)
			case evFailed:
				failed.Add(int64(count))
			}
		}}
	if parts > 0 {
		rs.OrderedSubjects = []string{orderedSubject + ".*"}
	}
	rel, _, err := newRelay(ctx, env, rs)
	if err != nil {
		return report.Result{}, err
	}
	consumers, err := newConsumers(env, cs)
	if err != nil {
		return report.Result{}, err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go progress(runCtx, s.Name(), "applied", n, applied.Load)
	meter, err := env.StartMeter(ctx)
	if err != nil {
		return report.Result{}, err
	}
	done := make(chan error, len(consumers)+1)
	for _, c := range consumers {
		go func() { done <- c.Run(runCtx) }()
	}
	go func() { done <- rel.Run(runCtx) }()
	waitErr := applied.wait(ctx, h.Opts.Timeout, "applied")
	meas, merr := meter.Stop(ctx)
	cancel()
	for range len(consumers) + 1 {
		if err := <-done; err != nil {
			return report.Result{}, err
		}
	}
	if waitErr != nil {
		return report.Result{}, waitErr
	}
	if merr != nil {
		return report.Result{}, merr
	}

	res := report.Result{Scenario: s.Name(), Row: row, N: n, Messages: n,
		Config: map[string]any{"partitions": parts, "ordering_keys": orderedKeys, "relay_batch": h.Opts.RelayBatch}}
	res.SetMeasurement(meas, n)
	// Verify: each message applied once; and how many were applied after a later
	// message of their key.
	var rows, distinct, inversions int
	err = env.Pool.QueryRow(ctx, `
SELECT count(*), count(DISTINCT (k, s)),
       count(*) FILTER (WHERE s < prev_max)
FROM (SELECT k, s, max(s) OVER (PARTITION BY k ORDER BY id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_max FROM bench_ordered) t`).
		Scan(&rows, &distinct, &inversions)
	if err != nil {
		return report.Result{}, fmt.Errorf("verify: %w", err)
	}
	switch {
	case rows != n || distinct != n:
		return report.Result{}, fmt.Errorf("VERIFY FAILED: %d effects, %d distinct, want %d", rows, distinct, n)
	case parts > 0 && inversions > 0:
		return report.Result{}, fmt.Errorf("VERIFY FAILED: %d messages applied after a later message of their key", inversions)
	}
	res.Verified = fmt.Sprintf("%d effects, once each; %d applied after a later message of their key", n, inversions)
	if f := failed.Load(); f > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("%d failed attempts retried", f))
	}
	fmt.Fprintf(os.Stderr, "[%s] %s: %.0f/s (%s)\n", s.Name(), row, res.Rate, res.Verified)
	return res, nil
}
