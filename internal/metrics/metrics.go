// Package metrics exposes what the worker is doing as Prometheus metrics, all
// prefixed idem_. Components report through plain callbacks (consumer.Config.OnOutcome,
// producer.MiddlewareConfig.OnOutcome, outbox.RelayConfig.OnBatch,
// dedupe.CollectorConfig.OnDeleted), so the libraries themselves do not depend on
// Prometheus; the outbox gauges are read from Postgres at scrape time.
package metrics

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Metrics is one worker's registry and instruments.
type Metrics struct {
	reg *prometheus.Registry

	messages  *prometheus.CounterVec
	ingress   *prometheus.CounterVec
	published *prometheus.CounterVec
	relayDur  prometheus.Histogram
	deleted   *prometheus.CounterVec
}

// New builds a registry with the Go and process collectors, the worker's counters,
// and outbox gauges read from pool at scrape time.
func New(pool *pgxpool.Pool, log *slog.Logger) *Metrics {
	m := &Metrics{reg: prometheus.NewRegistry()}
	m.messages = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idem_consumer_messages_total",
		Help: "Messages settled by consumers, by consumer and outcome (processed, duplicate, failed, dead_lettered).",
	}, []string{"consumer", "outcome"})
	m.ingress = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idem_ingress_requests_total",
		Help: "State-changing HTTP requests by outcome (new, replayed, conflict, mismatch, rejected, failed, unavailable).",
	}, []string{"outcome"})
	m.published = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idem_relay_messages_total",
		Help: "Outbox rows the relay handled, by result (published, failed).",
	}, []string{"result"})
	m.relayDur = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "idem_relay_batch_duration_seconds",
		Help:    "Time to claim, publish (until every PubAck) and mark one relay batch.",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
	})
	m.deleted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idem_collector_deleted_rows_total",
		Help: "Expired rows deleted by the retention collector, by table.",
	}, []string{"table"})
	m.reg.MustRegister(m.messages, m.ingress, m.published, m.relayDur, m.deleted,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		&outboxCollector{pool: pool, log: log})
	return m
}

// ConsumerOutcome is a consumer.Config.OnOutcome.
func (m *Metrics) ConsumerOutcome(consumer, outcome string, n int) {
	m.messages.WithLabelValues(consumer, outcome).Add(float64(n))
}

// IngressOutcome is a producer.MiddlewareConfig.OnOutcome.
func (m *Metrics) IngressOutcome(outcome string) { m.ingress.WithLabelValues(outcome).Inc() }

// RelayBatch is an outbox.RelayConfig.OnBatch.
func (m *Metrics) RelayBatch(published, failed int, elapsed time.Duration) {
	m.published.WithLabelValues("published").Add(float64(published))
	m.published.WithLabelValues("failed").Add(float64(failed))
	m.relayDur.Observe(elapsed.Seconds())
}

// CollectorDeleted is a dedupe.CollectorConfig.OnDeleted.
func (m *Metrics) CollectorDeleted(table string, n int64) {
	m.deleted.WithLabelValues(table).Add(float64(n))
}

// Handler serves /metrics.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// Registry is exposed for tests and for embedding applications' own metrics.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// outboxCollector reads the outbox backlog at scrape time: a counter kept in the
// worker could not see rows enqueued by other processes.
type outboxCollector struct {
	pool *pgxpool.Pool
	log  *slog.Logger
}

var (
	descPending = prometheus.NewDesc("idem_outbox_pending_rows", "Outbox rows not yet published.", nil, nil)
	descOldest  = prometheus.NewDesc("idem_outbox_oldest_unpublished_age_seconds", "Age of the oldest unpublished outbox row (0 when none).", nil, nil)
)

const sqlOutboxBacklog = `
SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8
FROM idem_outbox WHERE published_at IS NULL`

func (c *outboxCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descPending
	ch <- descOldest
}

func (c *outboxCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var pending int64
	var age float64
	if err := c.pool.QueryRow(ctx, sqlOutboxBacklog).Scan(&pending, &age); err != nil {
		c.log.Warn("metrics: outbox backlog query failed", "err", err)
		return
	}
	ch <- prometheus.MustNewConstMetric(descPending, prometheus.GaugeValue, float64(pending))
	ch <- prometheus.MustNewConstMetric(descOldest, prometheus.GaugeValue, age)
}
