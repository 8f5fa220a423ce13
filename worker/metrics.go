package worker

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/producer"
	"github.com/idemkit/idem/reconcile"
)

// metrics are the worker's Prometheus instruments, all prefixed idem_. They are fed
// by the components' events (one Observer for all), so the library packages
// themselves do not depend on Prometheus; the outbox gauges are read from Postgres
// at scrape time, because a counter kept in one worker cannot see rows enqueued by
// other processes.
type metrics struct {
	w         *Worker
	messages  *prometheus.CounterVec
	ingress   *prometheus.CounterVec
	relay     *prometheus.CounterVec
	relayDur  prometheus.Histogram
	deleted   *prometheus.CounterVec
	reconcile *prometheus.CounterVec
	scrapeErr *prometheus.CounterVec
}

func newMetrics(w *Worker) *metrics {
	return &metrics{
		w: w,
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
	}
}

// observe is the worker's own Observer.
func (m *metrics) observe(e idem.Event) {
	n := float64(e.Count)
	switch e.Component {
	case idem.ComponentConsumer:
		m.messages.WithLabelValues(e.Name, e.Outcome).Add(n)
	case idem.ComponentIngress:
		m.ingress.WithLabelValues(e.Outcome).Add(n)
	case idem.ComponentRelay:
		m.relay.WithLabelValues(e.Outcome).Add(n)
		if e.Outcome == outbox.OutcomePublished {
			m.relayDur.Observe(e.Duration.Seconds())
		}
	case idem.ComponentCollector:
		m.deleted.WithLabelValues(e.Name).Add(n)
	case idem.ComponentReconciler:
		m.reconcile.WithLabelValues(e.Outcome).Add(n)
	}
}

// RegisterMetrics registers the worker's metrics with reg: counters of every
// component's outcomes, relay batch durations, and gauges of the outbox backlog
// read at scrape time. Series for the known outcomes exist from the start, at 0, so
// a rate() over them is defined before the first event.
func (w *Worker) RegisterMetrics(reg prometheus.Registerer) error {
	m := w.metrics
	for _, c := range w.consumers {
		for _, o := range []string{consumer.OutcomeProcessed, consumer.OutcomeDuplicate, consumer.OutcomeFailed, consumer.OutcomeDeadLettered} {
			m.messages.WithLabelValues(c.Config().Name, o)
		}
	}
	if w.ingress != nil {
		for _, o := range []string{producer.OutcomeNew, producer.OutcomeReplayed, producer.OutcomeRejected, producer.OutcomeMismatch, producer.OutcomeConflict, producer.OutcomeFailed, producer.OutcomeUnavailable} {
			m.ingress.WithLabelValues(o)
		}
	}
	for _, o := range []string{outbox.OutcomePublished, outbox.OutcomeFailed} {
		m.relay.WithLabelValues(o)
	}
	if w.reconcile != nil {
		for _, o := range []string{reconcile.OutcomeCompleted, reconcile.OutcomeLagging, reconcile.OutcomeUnrouted, reconcile.OutcomeRedriven, reconcile.OutcomeAlerted} {
			m.reconcile.WithLabelValues(o)
		}
	}
	m.scrapeErr.WithLabelValues("outbox_backlog")
	m.scrapeErr.WithLabelValues("reconcile_status")
	for _, c := range []prometheus.Collector{m.messages, m.ingress, m.relay, m.relayDur, m.deleted, m.reconcile, m.scrapeErr, &backlogCollector{m: m}} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// backlogCollector reads the outbox backlog at scrape time.
type backlogCollector struct{ m *metrics }

var (
	descPending  = prometheus.NewDesc("idem_outbox_pending_rows", "Outbox rows not yet published.", nil, nil)
	descOldest   = prometheus.NewDesc("idem_outbox_oldest_unpublished_age_seconds", "Age of the oldest unpublished outbox row (0 when none).", nil, nil)
	descUnproven = prometheus.NewDesc("idem_outbox_unproven_rows", "Intents published but not yet settled by every consumer that reads them.", nil, nil)
	descOldestUn = prometheus.NewDesc("idem_outbox_oldest_unproven_age_seconds", "Age of the oldest published intent not yet settled by every consumer (0 when none).", nil, nil)
	descRedriven = prometheus.NewDesc("idem_outbox_redriven_rows", "Outbox rows still kept that the reconciler re-drove at least once (the stream lost them).", nil, nil)
	descAlerted  = prometheus.NewDesc("idem_outbox_alerted_rows", "Outbox rows still kept that the reconciler gave up on and dead-lettered: past every horizon.", nil, nil)
)

func (c *backlogCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descPending, descOldest, descUnproven, descOldestUn, descRedriven, descAlerted} {
		ch <- d
	}
}

func (c *backlogCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	w := c.m.w
	b, err := w.outbox.Backlog(ctx, w.pool)
	if err != nil {
		c.m.scrapeErr.WithLabelValues("outbox_backlog").Inc()
		w.log.WarnContext(ctx, "metrics: outbox backlog query failed", "err", err)
		return
	}
	ch <- prometheus.MustNewConstMetric(descPending, prometheus.GaugeValue, float64(b.Pending))
	ch <- prometheus.MustNewConstMetric(descOldest, prometheus.GaugeValue, b.OldestAge.Seconds())
	s, err := reconcile.ReadStatus(ctx, w.pool, w.cfg.Schema)
	if err != nil {
		c.m.scrapeErr.WithLabelValues("reconcile_status").Inc()
		w.log.WarnContext(ctx, "metrics: reconcile status query failed", "err", err)
		return
	}
	ch <- prometheus.MustNewConstMetric(descUnproven, prometheus.GaugeValue, float64(s.Unproven))
	ch <- prometheus.MustNewConstMetric(descOldestUn, prometheus.GaugeValue, s.OldestUnprovenAge.Seconds())
	ch <- prometheus.MustNewConstMetric(descRedriven, prometheus.GaugeValue, float64(s.Redriven))
	ch <- prometheus.MustNewConstMetric(descAlerted, prometheus.GaugeValue, float64(s.Alerted))
}
