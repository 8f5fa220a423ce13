package main

// worker stats: counts and lags across idem's tables and, when a JetStream server
// can be found, the stream's consumers.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/app/runenv"
	"github.com/idemkit/idem/embeddednats"
	"github.com/idemkit/idem/internal/ops"
	"github.com/idemkit/idem/internal/pgschema"
	"github.com/idemkit/idem/internal/relay"
)

const statsUsage = `usage: worker stats [flags]

Prints counts and lags: requests, the outbox backlog and the age of its oldest
unpublished row, inbox rows per consumer and status, dead letters, the reference
application's row counts, and stream IDEM's consumers when a JetStream server is
known (--nats-url, NATS_URL, or the embedded server a running worker recorded
under --data-dir): each one's lag (messages pending and delivered but not yet
acknowledged) and rate (deliveries it finished per second, between two readings
of the stream at least a second apart). A running worker warns in its log when one
of its consumers falls behind. --json prints one JSON document.

Exit status: 0 ok, 1 error, 2 usage error.

flags:
`

// statsOutput is what stats prints: the snapshot, plus where the JetStream figures
// came from or why there are none.
type statsOutput struct {
	*ops.Stats
	// JetStreamSource says where the NATS URL came from.
	JetStreamSource string `json:"jetstream_source,omitempty"`
	// JetStreamError explains missing JetStream figures.
	JetStreamError string `json:"jetstream_error,omitempty"`
	// ConsumerRates are the deliveries each consumer finished per second, between
	// two readings of the stream RateOverSeconds apart.
	ConsumerRates   map[string]float64 `json:"consumer_rates_per_s,omitempty"`
	RateOverSeconds float64            `json:"rate_over_seconds,omitempty"`
}

// rateOver is the least time between the two readings of the stream that give
// the consumers' rates.
const rateOver = time.Second

// statsOptions are the flags of worker stats.
type statsOptions struct {
	db     dbOptions
	nats   natsOptions
	asJSON bool
}

func (o *statsOptions) flags(fs *flagSet) {
	o.db.flags(fs)
	o.nats.flags(fs)
	fs.BoolVar(&o.asJSON, "json", false, "print JSON instead of text")
}

func (o *statsOptions) validate(args []string) error {
	if len(args) > 0 {
		return fmt.Errorf("stats: unexpected arguments %q", args)
	}
	if err := pgschema.Validate(o.db.schema); err != nil {
		return fmt.Errorf("stats: --schema: %w", err)
	}
	return nil
}

func (o *statsOptions) secrets() []*secret { return o.nats.secrets() }

func runStats(o *statsOptions, stdout, _ io.Writer) error {
	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	pool, err := openOpsPool(ctx, &o.db)
	if err != nil {
		return err
	}
	defer pool.Close()
	r, err := ops.New(pool, ops.Config{Schema: o.db.schema, Counts: refapp.Counts})
	if err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	out := statsOutput{}

	// JetStream is optional. A URL the user gave must work; a URL found in the data
	// dir may be stale (the worker stopped), which is worth a note, not a failure.
	// It is read before and after the database, for the consumers' rates.
	url, source, auth := o.nats.target(o.db.dataDir)
	var js *jetStreamReader
	var first *ops.JetStreamStats
	if url != "" {
		out.JetStreamSource = source
		js, err = openJetStream(url, auth)
		if err == nil {
			defer js.close()
			first, err = js.read(ctx)
		}
		if err != nil {
			if o.nats.url != "" {
				return fmt.Errorf("stats: %w", err)
			}
			out.JetStreamError = fmt.Sprintf("%v (the embedded server recorded in %s does not answer: is the worker running?)", err, source)
			js = nil
		}
	} else {
		out.JetStreamError = fmt.Sprintf("no --nats-url and no %s under --data-dir %s", runenv.NATSURLFile, o.db.dataDir)
	}

	st, err := r.Stats(ctx)
	if err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	out.Stats = st
	if js != nil {
		if err := sleep(ctx, rateOver-time.Since(first.At)); err != nil {
			return fmt.Errorf("stats: %w", err)
		}
		second, err := js.read(ctx)
		if err != nil {
			return fmt.Errorf("stats: %w", err)
		}
		st.JetStream = second
		hist := ops.NewLagHistory(time.Hour)
		hist.Add(first)
		hist.Add(second)
		tr := hist.Trends(second.At.Sub(first.At))
		out.ConsumerRates, out.RateOverSeconds = map[string]float64{}, tr.Window.Seconds()
		for _, c := range tr.Consumers {
			out.ConsumerRates[c.Name] = c.RatePerSec
		}
	}

	if o.asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(out)
	}
	writeStats(stdout, out)
	return nil
}

// jetStreamReader reads the reference application's stream.
type jetStreamReader struct {
	nc  *nats.Conn
	js  jetstream.JetStream
	url string // redacted
}

func openJetStream(url string, auth runenv.NATSAuth) (*jetStreamReader, error) {
	opts, err := auth.Options()
	if err != nil {
		return nil, err
	}
	// The URL of an embedded server carries its token: show it without.
	nc, err := nats.Connect(url, append([]nats.Option{nats.Name("idem-worker-stats"), nats.Timeout(3 * time.Second)}, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w", embeddednats.Redact(url), err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	return &jetStreamReader{nc: nc, js: js, url: embeddednats.Redact(url)}, nil
}

func (r *jetStreamReader) read(ctx context.Context) (*ops.JetStreamStats, error) {
	s, err := ops.ReadJetStream(ctx, r.js, refapp.StreamName)
	if err != nil {
		return nil, err
	}
	s.URL = r.url
	return s, nil
}

func (r *jetStreamReader) close() { r.nc.Close() }

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// relayLine says which relay publishes the outbox and, for the log relay, how far
// behind its slot is.
func relayLine(r relay.State) string {
	if r.Mode != relay.ModeLog {
		line := "polling (claims pending rows)"
		if r.SlotExists {
			line += fmt.Sprintf("; slot %s still exists and keeps %s of WAL", r.Slot, bytesHuman(r.SlotLagBytes))
		}
		return line
	}
	switch {
	case !r.SlotExists:
		return fmt.Sprintf("log, slot %s: missing (the next log relay to start makes it and hands what it never published to the polling relay)", r.Slot)
	case r.SlotLost:
		return fmt.Sprintf("log, slot %s: LOST, it needed WAL Postgres removed (max_slot_wal_keep_size); the next log relay to start makes it anew", r.Slot)
	}
	reading := "no relay reads it"
	if r.SlotActive {
		reading = "a relay reads it"
	}
	return fmt.Sprintf("log, slot %s: %s, %s behind (WAL since the position last confirmed)", r.Slot, reading, bytesHuman(r.SlotLagBytes))
}

// bytesHuman is n bytes for a reader.
func bytesHuman(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d bytes", n)
}

func writeStats(w io.Writer, out statsOutput) {
	st := out.Stats
	p := &printer{w: w, now: st.AsOf}
	p.line(0, "as of %s", st.AsOf.UTC().Format(timeLayout))
	p.line(0, "")

	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(cells ...any) {
		for i, c := range cells {
			if i > 0 {
				fmt.Fprint(tw, "\t")
			}
			fmt.Fprint(tw, c)
		}
		fmt.Fprintln(tw)
	}
	row("requests", fmt.Sprintf("%d total, %d running", st.Requests.Total, st.Requests.Running))
	ob := st.Outbox
	backlog := fmt.Sprintf("%d pending (%d failing), %d published", ob.Pending, ob.Failing, ob.Published)
	if ob.OldestPendingAt != nil {
		backlog += fmt.Sprintf("; oldest pending waits %s", human(time.Duration(ob.OldestPendingAgeSeconds*float64(time.Second))))
	}
	row("outbox", backlog)
	row("relay", relayLine(st.Relay))
	d := st.Delivery
	delivery := fmt.Sprintf("%d published but not yet consumed by every consumer (%d lagging, %d unrouted)", d.Unproven, d.Lagging, d.Unrouted)
	if d.Unproven > 0 {
		delivery += fmt.Sprintf("; oldest written %s ago", human(d.OldestUnprovenAge))
	}
	delivery += fmt.Sprintf("; %d re-driven, %d given up on", d.Redriven, d.Alerted)
	row("delivery", delivery)
	row("dead letters", fmt.Sprintf("%d total, %d not replayed", st.DeadLetters.Total, st.DeadLetters.NotReplayed))
	if len(st.Counts) > 0 {
		counts := make([]string, len(st.Counts))
		for i, c := range st.Counts {
			counts[i] = fmt.Sprintf("%s %d", c.Name, c.N)
		}
		row("application rows", strings.Join(counts, ", "))
	}
	tw.Flush()

	p.line(0, "")
	if len(st.Consumers) == 0 {
		p.line(0, "registered consumers: none")
	} else {
		p.line(0, "registered consumers")
		row("  consumer", "stream", "filter", "key lifetime", "last seen")
		for _, c := range st.Consumers {
			row("  "+c.Name, c.Stream, c.FilterSubject, human(c.KeyLifetime), human(st.AsOf.Sub(c.LastSeen))+" ago")
		}
		tw.Flush()
	}

	p.line(0, "")
	if len(st.Inbox) == 0 {
		p.line(0, "inbox: empty")
	} else {
		p.line(0, "inbox")
		row("  consumer", "status", "rows", "expired", "lease expired")
		for _, c := range st.Inbox {
			row("  "+c.Consumer, c.Status, c.Rows, c.Expired, c.LeaseExpired)
		}
		tw.Flush()
	}

	p.line(0, "")
	js := st.JetStream
	if js == nil {
		p.line(0, "jetstream: %s", out.JetStreamError)
		return
	}
	p.line(0, "jetstream %s (from %s)", js.URL, out.JetStreamSource)
	p.line(1, "stream %s: %d messages, %d bytes, sequences %d..%d", js.Stream, js.Messages, js.Bytes, js.FirstSeq, js.LastSeq)
	if len(js.Consumers) == 0 {
		p.line(1, "no consumers")
		return
	}
	row("  consumer", "subjects", "lag", "rate", "pending", "ack pending", "redelivered", "ack floor")
	for _, c := range js.Consumers {
		rate := "—"
		if r, ok := out.ConsumerRates[c.Name]; ok {
			rate = fmt.Sprintf("%.1f/s", r)
		}
		row("  "+c.Name, strings.Join(c.FilterSubjects, ","), c.Lag, rate, c.NumPending, c.NumAckPending, c.NumRedelivered, c.AckFloor)
	}
	tw.Flush()
	p.line(1, "lag: messages not yet finished (pending + ack pending); rate: deliveries finished per second over the last %s",
		time.Duration(out.RateOverSeconds*float64(time.Second)).Round(10*time.Millisecond))
}
