package scenario

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/cmd/bench/internal/measure"
	"github.com/idemkit/idem/cmd/bench/internal/report"
	"github.com/idemkit/idem/embeddednats"
	"github.com/idemkit/idem/internal/jsbatch"
)

// publishBatch measures what JetStream's atomic batch publish would buy the
// relay, measured against what the relay does now. Both publish N messages, each
// with its own Nats-Msg-Id, in batches of -relay-batch, one batch at a time as a
// relay batch goes (publish, wait for the broker, then the next):
//
//   - async: PublishMsgAsync for every message, then wait for every PubAck (the
//     relay's way);
//   - atomic: one batch id per batch (Nats-Batch-Id, Nats-Batch-Sequence), every
//     message but the last published without a reply, the last with
//     Nats-Batch-Commit and one PubAck for the batch. The stream needs
//     AllowAtomicPublish.
//
// Each runs at both of the broker's durabilities, JetStream's default sync and
// fsync on every write, on a fresh embedded server each. Postgres takes no part.
// A last check publishes one atomic batch whose messages the stream already
// holds, and reports what the broker answers: the relay re-publishes after a
// crash, and relies on the Msg-Id dedupe to fold what is already stored.
type publishBatch struct{}

func (publishBatch) Name() string { return "publish-batch" }

func (publishBatch) Summary() string {
	return "the relay's publish (async, a PubAck each) against JetStream's atomic batch publish, at both broker durabilities; no Postgres"
}

// publishVariant is one row of publish-batch.
type publishVariant struct {
	row                string
	syncAlways, atomic bool
}

func publishVariants() []publishVariant {
	var out []publishVariant
	for _, syncAlways := range []bool{false, true} {
		for _, atomic := range []bool{false, true} {
			row := "publish, async + PubAck each"
			if atomic {
				row = "publish, atomic batch, one PubAck"
			}
			if syncAlways {
				row += ", fsync always"
			} else {
				row += ", default sync"
			}
			out = append(out, publishVariant{row, syncAlways, atomic})
		}
	}
	return out
}

func (s publishBatch) Rows(Options) []string {
	var out []string
	for _, v := range publishVariants() {
		out = append(out, v.row)
	}
	return out
}

const (
	publishStream  = "PUBBENCH"
	publishSubject = "pubbench.charges"
)

func (s publishBatch) Run(ctx context.Context, h *Harness) ([]report.Result, error) {
	var out []report.Result
	for _, v := range publishVariants() {
		res, err := s.variant(ctx, h.Opts, v)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.Name(), err)
		}
		fmt.Fprintf(os.Stderr, "[%s] %s: %.0f msgs/s\n", s.Name(), res.Row, res.Rate)
		out = append(out, res)
	}
	return out, nil
}

func (s publishBatch) variant(ctx context.Context, opts Options, v publishVariant) (report.Result, error) {
	n, batch, syncAlways, atomic := opts.N, max(opts.RelayBatch, 1), v.syncAlways, v.atomic
	res := report.Result{Scenario: s.Name(), Row: v.row, N: n, Messages: n,
		Config: map[string]any{"batch": batch, "sync_always": syncAlways, "atomic": atomic}}

	dir, err := os.MkdirTemp("", "idem-bench-publish-")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(dir)
	srv, err := embeddednats.Start(embeddednats.Config{StoreDir: dir, SyncAlways: syncAlways})
	if err != nil {
		return res, err
	}
	defer srv.Shutdown()
	nc, err := nats.Connect(srv.URL(), nats.Name("idem-bench-publish"))
	if err != nil {
		return res, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(max(4096, batch)))
	if err != nil {
		return res, err
	}
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: publishStream, Subjects: []string{"pubbench.>"},
		Storage: jetstream.FileStorage, AllowAtomicPublish: atomic})
	if err != nil {
		return res, fmt.Errorf("create stream: %w", err)
	}

	// The messages are built before the clock starts: a charge-sized payload and
	// a Msg-Id each, as the relay sends them.
	payload := []byte(`{"account":"acct-000042","amount_cents":1999,"currency":"EUR","note":"bench"}`)
	msgs := make([]*nats.Msg, n)
	for i := range msgs {
		m := nats.NewMsg(publishSubject)
		m.Data = payload
		m.Header.Set(jetstream.MsgIDHeader, "bench-"+strconv.Itoa(i))
		msgs[i] = m
	}

	before, err := measure.SelfCPU()
	if err != nil {
		return res, err
	}
	start := time.Now()
	for lo := 0; lo < n; lo += batch {
		part := msgs[lo:min(lo+batch, n)]
		if atomic {
			err = publishAtomic(nc, part)
		} else {
			_, err = publishAsync(ctx, js, part)
		}
		if err != nil {
			return res, fmt.Errorf("batch at %d: %w", lo, err)
		}
	}
	elapsed := time.Since(start)
	after, err := measure.SelfCPU()
	if err != nil {
		return res, err
	}
	res.SetMeasurement(measure.Measurement{Elapsed: elapsed, ProcCPU: after - before}, n)

	info, err := stream.Info(ctx)
	if err != nil {
		return res, err
	}
	if info.State.Msgs != uint64(n) {
		return res, fmt.Errorf("VERIFY FAILED: the stream holds %d messages, want %d", info.State.Msgs, n)
	}
	res.Verified = fmt.Sprintf("%d messages stored", info.State.Msgs)
	res.Notes = append(res.Notes, fmt.Sprintf("%d messages in batches of %d, one batch at a time", n, batch))

	if atomic {
		// What a relay re-publishing after a crash would meet.
		again := msgs[:min(batch, n)]
		err := publishAtomic(nc, again)
		res.Notes = append(res.Notes, fmt.Sprintf("re-publishing a batch of %d stored Msg-Ids atomically: %v", len(again), errOr(err, "accepted")))
	} else {
		again := msgs[:min(batch, n)]
		dups, err := publishAsync(ctx, js, again)
		res.Notes = append(res.Notes, fmt.Sprintf("re-publishing %d stored Msg-Ids: %v", len(again),
			errOr(err, fmt.Sprintf("%d answered as duplicates, each with its PubAck", dups))))
	}
	if info, err = stream.Info(ctx); err == nil && info.State.Msgs != uint64(n) {
		return res, fmt.Errorf("VERIFY FAILED: after re-publishing the stream holds %d messages, want %d", info.State.Msgs, n)
	}
	return res, nil
}

// publishAsync is the relay's way: every message async, then wait for every ack.
// It returns how many the broker answered as duplicates.
func publishAsync(ctx context.Context, js jetstream.JetStream, msgs []*nats.Msg) (duplicates int, err error) {
	futures := make([]jetstream.PubAckFuture, len(msgs))
	for i, m := range msgs {
		f, err := js.PublishMsgAsync(m)
		if err != nil {
			return duplicates, err
		}
		futures[i] = f
	}
	for _, f := range futures {
		select {
		case ack := <-f.Ok():
			if ack.Duplicate {
				duplicates++
			}
		case err := <-f.Err():
			return duplicates, err
		case <-ctx.Done():
			return duplicates, ctx.Err()
		}
	}
	return duplicates, nil
}

// publishAtomic sends msgs as one atomic batch (jsbatch, as the relay does),
// answered by one PubAck. The headers are set on copies, so the caller's messages
// stay as they were.
func publishAtomic(nc *nats.Conn, msgs []*nats.Msg) error {
	batch := make([]*nats.Msg, len(msgs))
	for i, m := range msgs {
		c := nats.NewMsg(m.Subject)
		c.Data = m.Data
		for k, v := range m.Header {
			c.Header[k] = v
		}
		batch[i] = c
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := jsbatch.Publish(ctx, nc, batch)
	return err
}

func errOr(err error, ok string) string {
	if err != nil {
		return err.Error()
	}
	return ok
}
