package worker

import (
	"context"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/buildinfo"
	"github.com/idemkit/idem/internal/ops"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/reconcile"
	"github.com/idemkit/idem/internal/relay"
)

// metrics are the worker's Prometheus instruments, all prefixed idem_. They are fed
// by the components' events (one Observer for all), so the library packages
// themselves do not depend on Prometheus; the outbox gauges are read from Postgres
// at scrape time, because a counter kept in one worker cannot see rows enqueued by
// other processes.
type metrics struct {
	w         *Worker
	lag       *lagWatch
	messages  *prometheus.CounterVec
	ingress   *prometheus.CounterVec
	relay     *prometheus.CounterVec
	relayDur  prometheus.Histogram
	deleted   *prometheus.CounterVec
	reconcile *prometheus.CounterVec
	scrapeErr *prometheus.CounterVec

	ingressDur *prometheus.HistogramVec
	batchDur   *prometheus.HistogramVec
	handlerDur *prometheus.HistogramVec
	endToEnd   *prometheus.HistogramVec
	buildInfo  *prometheus.GaugeVec
}

// latencyBuckets span 0.5 ms to about 16 s, doubling: a request or a batch takes
// milliseconds, a message that waited out an outage takes seconds.
var latencyBuckets = prometheus.ExponentialBuckets(0.0005, 2, 16)

func newMetrics(w *Worker) *metrics {
	return &metrics{
		w:   w,
		lag: &lagWatch{w: w, hist: ops.NewLagHistory(lagKeep), every: lagEvery, window: lagWindow, behind: map[string]bool{}},
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_consumer_messages_total",
			Help: "Messages settled by consumers, by consumer and outcome (processed, duplicate, failed, dead_lettered, busy).",
		}, []string{"consumer", "outcome"}),
		ingress: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_ingress_requests_total",
			Help: "State-changing HTTP requests by outcome (new, replayed, conflict, mismatch, rejected, failed, unavailable).",
		}, []string{"outcome"}),
		relay: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_relay_messages_total",
			Help: "Outbox rows the relay handled, by outcome (published, failed).",
		}, []string{"outcome"}),
		relayDur: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "idem_relay_batch_duration_seconds",
			Help:    "Time to claim, publish (until every PubAck) and mark one relay batch.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		deleted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_collector_deleted_rows_total",
			Help: "Expired rows deleted by the retention collector, by table.",
		}, []string{"table"}),
		reconcile: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_reconciler_rows_total",
			Help: "Published outbox rows the reconciler judged, by verdict (completed, lagging, unrouted, redriven, alerted); lagging and unrouted count each look.",
		}, []string{"outcome"}),
		scrapeErr: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_scrape_errors_total",
			Help: "Scrape-time queries that failed, by query: a gauge that is missing from a scrape is explained here.",
		}, []string{"query"}),
		ingressDur: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idem_ingress_request_duration_seconds",
			Help:    "State-changing HTTP requests through the ingress, from arrival to the response decided, by outcome.",
			Buckets: latencyBuckets,
		}, []string{"outcome"}),
		batchDur: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idem_consumer_batch_duration_seconds",
			Help:    "Consumer batches that processed messages: claim, handlers, results and commit (an external effect: one message's lease to completion), by consumer.",
			Buckets: latencyBuckets,
		}, []string{"consumer"}),
		handlerDur: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idem_consumer_handler_duration_seconds",
			Help:    "Time a processed batch spent in the application's handlers (an external effect: its Perform), by consumer.",
			Buckets: latencyBuckets,
		}, []string{"consumer"}),
		endToEnd: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idem_end_to_end_latency_seconds",
			Help:    "Per message processed: outbox row created (the database's clock) to the consumer's commit (the worker's clock), by consumer.",
			Buckets: latencyBuckets,
		}, []string{"consumer"}),
		buildInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "idem_build_info",
			Help: "Always 1; the labels say which build of idem runs.",
		}, []string{"version", "revision", "go_version"}),
	}
}

// observe is the worker's own Observer.
func (m *metrics) observe(e idem.Event) {
	n := float64(e.Count)
	switch e.Component {
	case idem.ComponentConsumer:
		m.messages.WithLabelValues(e.Name, string(e.Outcome)).Add(n)
		if e.Outcome == idem.OutcomeProcessed {
			m.batchDur.WithLabelValues(e.Name).Observe(e.Duration.Seconds())
			m.handlerDur.WithLabelValues(e.Name).Observe(e.HandlerDuration.Seconds())
			h := m.endToEnd.WithLabelValues(e.Name)
			for _, d := range e.EndToEnd {
				// A negative latency is clock skew between the database and this
				// host; it is kept at 0 rather than dropped, so counts still add up.
				h.Observe(max(d.Seconds(), 0))
			}
		}
	case idem.ComponentIngress:
		m.ingress.WithLabelValues(string(e.Outcome)).Add(n)
		m.ingressDur.WithLabelValues(string(e.Outcome)).Observe(e.Duration.Seconds())
	case idem.ComponentRelay:
		m.relay.WithLabelValues(string(e.Outcome)).Add(n)
		if e.Outcome == idem.OutcomePublished {
			m.relayDur.Observe(e.Duration.Seconds())
		}
	case idem.ComponentCollector:
		m.deleted.WithLabelValues(e.Name).Add(n)
	case idem.ComponentReconciler:
		m.reconcile.WithLabelValues(string(e.Outcome)).Add(n)
	}
}

// RegisterMetrics registers the worker's metrics with reg: counters of every
// component's outcomes; histograms of ingress requests, relay and consumer batches,
// handler time and end-to-end latency (outbox row created to consumer commit);
// gauges read at scrape time of the outbox backlog, intents not yet proven, each
// durable consumer's pending, ack-pending and redelivered messages, and open dead
// letters; whether each consumer falls behind (idem_consumer_behind, from the
// worker's LagHistory) and whether the collector holds because the database's
// clock jumped (idem_collector_clock_held, idem_collector_clock_skew_seconds); the
// NATS connection's state (idem_nats_connected, idem_nats_disconnected_seconds,
// idem_nats_reconnects_total); and idem_build_info. Series for the known outcomes (and each consumer's
// histograms) exist from the start, at 0, so a rate() over them is defined before
// the first event.
func (w *Worker) RegisterMetrics(reg prometheus.Registerer) error {
	m := w.metrics
	for _, c := range w.consumers {
		name := c.Config().Name
		for _, o := range []idem.Outcome{idem.OutcomeProcessed, idem.OutcomeDuplicate, idem.OutcomeFailed, idem.OutcomeDeadLettered} {
			m.messages.WithLabelValues(name, string(o))
		}
		m.batchDur.WithLabelValues(name)
		m.handlerDur.WithLabelValues(name)
		m.endToEnd.WithLabelValues(name)
	}
	if w.ingress != nil {
		for _, o := range []idem.Outcome{idem.OutcomeNew, idem.OutcomeReplayed, idem.OutcomeRejected, idem.OutcomeMismatch, idem.OutcomeConflict, idem.OutcomeFailed, idem.OutcomeUnavailable} {
			m.ingress.WithLabelValues(string(o))
			m.ingressDur.WithLabelValues(string(o))
		}
	}
	for _, o := range []idem.Outcome{idem.OutcomePublished, idem.OutcomeFailed} {
		m.relay.WithLabelValues(string(o))
	}
	if w.reconcile != nil {
		for _, o := range []idem.Outcome{idem.OutcomeCompleted, idem.OutcomeLagging, idem.OutcomeUnrouted, idem.OutcomeRedriven, idem.OutcomeAlerted} {
			m.reconcile.WithLabelValues(string(o))
		}
	}
	for _, q := range []string{scrapeBacklog, scrapeReconcile, scrapeJetStream, scrapeDeadLetters, scrapeRelay} {
		m.scrapeErr.WithLabelValues(q)
	}
	bi := buildinfo.Read()
	m.buildInfo.WithLabelValues(bi.Version, bi.Revision, bi.GoVersion).Set(1)
	reader, err := ops.New(w.pool, ops.Config{Schema: w.inst.Schema()})
	if err != nil {
		return err
	}
	for _, c := range []prometheus.Collector{m.messages, m.ingress, m.relay, m.relayDur, m.deleted, m.reconcile, m.scrapeErr,
		m.ingressDur, m.batchDur, m.handlerDur, m.endToEnd, m.buildInfo, &backlogCollector{m: m, ops: reader}} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// backlogCollector reads, at scrape time, what no single worker counts: the
// outbox backlog, the intents not yet proven, JetStream's view of each consumer,
// and the open dead letters. Each read goes through the same query as `worker
// stats`; a failed one is counted in idem_scrape_errors_total{query} and logged,
// and only its own series are missing from that scrape.
type backlogCollector struct {
	m   *metrics
	ops *ops.Reader
}

// The query label of idem_scrape_errors_total.
const (
	scrapeBacklog     = "outbox_backlog"
	scrapeReconcile   = "reconcile_status"
	scrapeJetStream   = "jetstream_consumers"
	scrapeDeadLetters = "dead_letters"
	scrapeRelay       = "relay_slot"
)

var (
	descPending  = prometheus.NewDesc("idem_outbox_pending_rows", "Outbox rows not yet published.", nil, nil)
	descOldest   = prometheus.NewDesc("idem_outbox_oldest_unpublished_age_seconds", "Age of the oldest unpublished outbox row (0 when none).", nil, nil)
	descUnproven = prometheus.NewDesc("idem_outbox_unproven_rows", "Intents published but not yet settled by every consumer that reads them.", nil, nil)
	descOldestUn = prometheus.NewDesc("idem_outbox_oldest_unproven_age_seconds", "Age of the oldest published intent not yet settled by every consumer (0 when none).", nil, nil)
	descRedriven = prometheus.NewDesc("idem_outbox_redriven_rows", "Outbox rows still kept that the reconciler re-drove at least once (the stream lost them).", nil, nil)
	descAlerted  = prometheus.NewDesc("idem_outbox_alerted_rows", "Outbox rows still kept that the reconciler gave up on and dead-lettered: past every horizon.", nil, nil)
	descJSPend   = prometheus.NewDesc("idem_consumer_pending_messages", "Messages in the stream not yet delivered to the durable consumer (JetStream's num_pending), by consumer.", []string{"consumer"}, nil)
	descJSAck    = prometheus.NewDesc("idem_consumer_ack_pending_messages", "Messages delivered to the durable consumer and not yet acknowledged (num_ack_pending), by consumer.", []string{"consumer"}, nil)
	descJSRedel  = prometheus.NewDesc("idem_consumer_redelivered_messages", "Messages delivered more than once and still unacknowledged (num_redelivered), by consumer.", []string{"consumer"}, nil)
	descDead     = prometheus.NewDesc("idem_dead_letters", "Dead letters not yet replayed, by consumer (the relay's under \"(relay)\").", []string{"consumer"}, nil)
	descHeld     = prometheus.NewDesc("idem_collector_clock_held", "1 while the collector holds because the database's clock jumped ahead of the worker's: no expired row is deleted, no partition dropped.", nil, nil)
	descBehind   = prometheus.NewDesc("idem_consumer_behind", "1 while the durable consumer falls behind: its lag has not reached 0 for a minute and exceeds what it finished in that minute, by consumer.", []string{"consumer"}, nil)
	descSlotLag  = prometheus.NewDesc("idem_relay_slot_lag_bytes", "WAL the log relay's replication slot holds: written since the position the relay last confirmed (present while the log relay publishes the outbox).", nil, nil)
	descSlotUp   = prometheus.NewDesc("idem_relay_slot_active", "1 while a log relay streams the slot (present while the log relay publishes the outbox).", nil, nil)
	descSkew     = prometheus.NewDesc("idem_collector_clock_skew_seconds", "How far the database's clock ran ahead of the worker's monotonic clock between the collector's last two rounds (negative: behind).", nil, nil)
	descNATSUp   = prometheus.NewDesc("idem_nats_connected", "1 while the worker's NATS connection is connected; 0 while it is disconnected, reconnecting or closed.", nil, nil)
	descNATSAway = prometheus.NewDesc("idem_nats_disconnected_seconds", "How long the worker's NATS connection has been away from the broker (0 while connected).", nil, nil)
	descNATSRe   = prometheus.NewDesc("idem_nats_reconnects_total", "Times the worker's NATS connection reconnected to the broker.", nil, nil)
)

func (c *backlogCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descPending, descOldest, descUnproven, descOldestUn, descRedriven, descAlerted, descJSPend, descJSAck, descJSRedel, descDead, descHeld, descSkew, descBehind, descSlotLag, descSlotUp,
		descNATSUp, descNATSAway, descNATSRe} {
		ch <- d
	}
}

func (c *backlogCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	w := c.m.w
	failed := func(query string, err error) {
		c.m.scrapeErr.WithLabelValues(query).Inc()
		w.log.WarnContext(ctx, "metrics: scrape-time query failed; its series are missing from this scrape", "query", query, "err", err)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}

	// Every consumer of this worker has a series from the start, at 0 until it is
	// judged; the others as soon as a reading shows them.
	behind := map[string]bool{}
	for _, wc := range w.consumers {
		behind[wc.Config().Name] = false
	}
	if tr := c.m.lag.hist.Trends(c.m.lag.window); tr != nil {
		for _, ct := range tr.Consumers {
			behind[ct.Name] = ct.Behind
		}
	}
	for name, b := range behind {
		gauge(descBehind, b2f(b), name)
	}
	// The connection's state needs no query: it is there even while the broker,
	// and the JetStream gauges below, are not.
	st, away := w.broker.state()
	gauge(descNATSUp, b2f(st == nats.CONNECTED))
	gauge(descNATSAway, away.Seconds())
	ch <- prometheus.MustNewConstMetric(descNATSRe, prometheus.CounterValue, float64(w.js.Conn().Stats().Reconnects))
	if w.collector != nil {
		skew, held := w.collector.clock.state()
		gauge(descSkew, skew.Seconds())
		gauge(descHeld, b2f(held))
	}
	if b, err := ops.ReadBacklog(ctx, w.pool, parts.Of(w.inst).Store); err != nil {
		failed(scrapeBacklog, err)
	} else {
		gauge(descPending, float64(b.Pending))
		gauge(descOldest, b.OldestAge.Seconds())
	}
	if s, err := reconcile.ReadStatus(ctx, w.pool, w.inst.Schema()); err != nil {
		failed(scrapeReconcile, err)
	} else {
		gauge(descUnproven, float64(s.Unproven))
		gauge(descOldestUn, s.OldestUnprovenAge.Seconds())
		gauge(descRedriven, float64(s.Redriven))
		gauge(descAlerted, float64(s.Alerted))
	}
	if w.relay != nil {
		if r, err := relay.ReadState(ctx, w.pool, parts.Of(w.inst).Store, w.inst.Schema()); err != nil {
			failed(scrapeRelay, err)
		} else if r.Mode == relay.ModeLog {
			gauge(descSlotLag, float64(r.SlotLagBytes))
			gauge(descSlotUp, b2f(r.SlotActive))
		}
	}
	if js, err := ops.ReadJetStream(ctx, w.js, w.inst.Stream().Name); err != nil {
		failed(scrapeJetStream, err)
	} else {
		for _, cl := range js.Consumers {
			gauge(descJSPend, float64(cl.NumPending), cl.Name)
			gauge(descJSAck, float64(cl.NumAckPending), cl.Name)
			gauge(descJSRedel, float64(cl.NumRedelivered), cl.Name)
		}
	}
	if open, err := c.ops.OpenDeadLetters(ctx); err != nil {
		failed(scrapeDeadLetters, err)
	} else {
		// Every consumer of this worker has a series, at 0 when it has none.
		for _, wc := range w.consumers {
			if _, ok := open[wc.Config().Name]; !ok {
				open[wc.Config().Name] = 0
			}
		}
		for name, n := range open {
			gauge(descDead, float64(n), name)
		}
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// The worker reads its stream's durable consumers every lagEvery and keeps the
// readings for lagKeep (the console's plot); a consumer falls behind over
// lagWindow (ops.ConsumerTrend.Behind).
const (
	lagEvery  = 10 * time.Second
	lagKeep   = 15 * time.Minute
	lagWindow = time.Minute
)

// lagWatch reads the stream's consumers into the worker's LagHistory and warns
// when one of this worker's consumers falls behind, and when it has caught up.
type lagWatch struct {
	w             *Worker
	hist          *ops.LagHistory
	every, window time.Duration
	behind        map[string]bool // by consumer: as last said; run's alone
}

func (l *lagWatch) run(ctx context.Context) error {
	// The first reading waits a moment for the consumers, started beside it, to
	// have bound their durable consumers.
	first := time.NewTimer(min(l.every, time.Second))
	defer first.Stop()
	select {
	case <-ctx.Done():
		return nil
	case <-first.C:
	}
	t := time.NewTicker(l.every)
	defer t.Stop()
	for {
		l.sample(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (l *lagWatch) sample(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, max(l.every, 2*time.Second))
	defer cancel()
	js, err := ops.ReadJetStream(rctx, l.w.js, l.w.inst.Stream().Name)
	if err != nil {
		// The stream keeper and readiness report a missing stream.
		if ctx.Err() == nil {
			l.w.log.DebugContext(ctx, "lag: reading the stream's consumers failed", "err", err)
		}
		return
	}
	l.hist.Add(js)
	tr := l.hist.Trends(l.window)
	// Each worker speaks of its own consumers only: the one the operator must
	// look at is named by the processes that run it.
	own := map[string]bool{}
	for _, c := range l.w.consumers {
		own[c.Config().Name] = true
	}
	for _, ct := range tr.Consumers {
		if !own[ct.Name] || ct.Behind == l.behind[ct.Name] {
			continue
		}
		l.behind[ct.Name] = ct.Behind
		attrs := []any{"consumer", ct.Name, "lag", ct.Lag, "rate_per_s", round2(ct.RatePerSec), "window", tr.Window}
		if ct.Behind {
			l.w.log.WarnContext(ctx, "consumer falls behind: its lag has not reached 0 for a whole window and exceeds what it finished in it, "+
				"so it is the bottleneck; raise its Concurrency, or make its handler faster", attrs...)
		} else {
			l.w.log.InfoContext(ctx, "consumer keeps up again", attrs...)
		}
	}
}

func round2(f float64) float64 { return float64(int64(f*100+0.5)) / 100 }

// The worker's lag history (its recent readings of its stream's durable
// consumers, every one on the stream whoever runs it, from Start to Stop; the
// console's plot, console.Config.Lag) is read through ops.LagOf, so the public
// Worker exports no internal type.
func init() { ops.RegisterLagOf(func(w any) *ops.LagHistory { return w.(*Worker).metrics.lag.hist }) }
