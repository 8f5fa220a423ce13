package refapp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/producer"
	"github.com/idemkit/idem/worker"
)

// Service is the running application: the worker (consumers, relay, retention) and
// the HTTP server (the API when the ingress role is on, /healthz, /readyz,
// /metrics).
type Service struct {
	worker *worker.Worker
	http   *http.Server
	ln     net.Listener
	// metrics serves /metrics when Config.MetricsAddr is set (nil otherwise).
	metrics   *http.Server
	metricsLn net.Listener
	log       *slog.Logger
	served    sync.WaitGroup
	errs      chan error
}

// Start runs the application on pool and nc, which stay the caller's. It binds the
// HTTP address first, so that a busy port is found before any message is taken; then
// it migrates the application's tables (unless NoMigrate) and starts the worker,
// which migrates idem's, ensures the stream and checks the lifetime invariant.
func Start(ctx context.Context, pool *pgxpool.Pool, nc *nats.Conn, cfg Config) (*Service, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.HTTPAddr == "" {
		cfg.HTTPAddr = "127.0.0.1:8080"
	}
	if cfg.PayPage && cfg.DisableIngress {
		return nil, errors.New("refapp: the payment page posts to the ingress on its own listener: run the ingress role where it is served, or turn the page off")
	}
	wc, err := cfg.WorkerConfig()
	if err != nil {
		return nil, err
	}
	inst, err := install.New(pool, nc, cfg.InstallConfig())
	if err != nil {
		return nil, err
	}
	w, err := worker.New(inst, wc)
	if err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if err := w.RegisterMetrics(reg); err != nil {
		return nil, fmt.Errorf("refapp: metrics: %w", err)
	}

	ln, err := net.Listen("tcp", cfg.HTTPAddr)
	if err != nil {
		return nil, fmt.Errorf("refapp: listen on %s: %w", cfg.HTTPAddr, err)
	}
	var metricsLn net.Listener
	if cfg.MetricsAddr != "" {
		if metricsLn, err = net.Listen("tcp", cfg.MetricsAddr); err != nil {
			ln.Close()
			return nil, fmt.Errorf("refapp: listen on %s (metrics): %w", cfg.MetricsAddr, err)
		}
	}
	closeListeners := func() {
		ln.Close()
		if metricsLn != nil {
			metricsLn.Close()
		}
	}
	var consoleHandler http.Handler
	if cfg.Console.Enabled {
		consoleLn := ln
		if metricsLn != nil {
			consoleLn = metricsLn
		}
		if consoleHandler, err = newConsole(pool, w, reg, cfg, consoleLn.Addr()); err != nil {
			closeListeners()
			return nil, err
		}
	}
	if !cfg.NoMigrate {
		if err := Migrate(ctx, pool); err != nil {
			closeListeners()
			return nil, err
		}
	}
	if err := w.Start(ctx); err != nil {
		closeListeners()
		return nil, err
	}

	metricsHandler := promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	mux := http.NewServeMux()
	mux.Handle("GET /healthz", w.LiveHandler())
	mux.Handle("GET /readyz", w.ReadyHandler())
	if metricsLn == nil {
		mux.Handle("GET /metrics", metricsHandler)
		mountConsole(mux, consoleHandler)
	}
	if mw := w.Ingress(); mw != nil {
		mux.Handle("/v1/", traced(cfg.TracerProvider, Routes(mw, cfg.Logger)))
		if cfg.PayPage {
			mountPayPage(mux, newPayPage(pool, cfg.Logger))
		}
	}
	hc := cfg.HTTP.withDefaults()
	s := &Service{worker: w, ln: ln, log: cfg.Logger, errs: make(chan error, 1),
		http: &http.Server{
			Handler:           mux,
			ReadHeaderTimeout: hc.ReadHeaderTimeout,
			ReadTimeout:       hc.ReadTimeout,
			WriteTimeout:      hc.WriteTimeout,
			IdleTimeout:       hc.IdleTimeout,
			MaxHeaderBytes:    hc.MaxHeaderBytes,
			ErrorLog:          slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelWarn),
			// Requests see the values Start's ctx carries (a trace, test fault
			// points), not its cancellation.
			BaseContext: func(net.Listener) context.Context { return context.WithoutCancel(ctx) },
		}}
	// Through the guard: net/http would run a request hidden in the body of one
	// that carries both Content-Length and Transfer-Encoding.
	s.serve(s.http, producer.GuardListener(ln, cfg.Logger), "http")
	cfg.Logger.InfoContext(ctx, "http listening", "addr", ln.Addr().String())
	if metricsLn != nil {
		mm := http.NewServeMux()
		mm.Handle("GET /metrics", metricsHandler)
		mountConsole(mm, consoleHandler)
		s.metrics = &http.Server{Handler: mm, ReadHeaderTimeout: hc.ReadHeaderTimeout, ReadTimeout: hc.ReadTimeout,
			WriteTimeout: hc.WriteTimeout, IdleTimeout: hc.IdleTimeout, MaxHeaderBytes: hc.MaxHeaderBytes,
			ErrorLog: slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelWarn)}
		s.metricsLn = metricsLn
		s.serve(s.metrics, producer.GuardListener(metricsLn, cfg.Logger), "metrics")
		cfg.Logger.InfoContext(ctx, "metrics listening", "addr", metricsLn.Addr().String())
	}
	return s, nil
}

// serve runs srv on ln until Shutdown; a failure is the service's.
func (s *Service) serve(srv *http.Server, ln net.Listener, what string) {
	s.served.Add(1)
	go func() {
		defer s.served.Done()
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			select {
			case s.errs <- fmt.Errorf("refapp: %s: %w", what, err):
			default: // the first failure is reported; this one is logged
				s.log.Error("refapp: server failed", "server", what, "err", err)
			}
		}
	}()
}

// MetricsAddr is the address of the metrics listener, or "" when /metrics is
// served on Addr.
func (s *Service) MetricsAddr() string {
	if s.metricsLn == nil {
		return ""
	}
	return s.metricsLn.Addr().String()
}

// Addr is the address the HTTP server listens on.
func (s *Service) Addr() string { return s.ln.Addr().String() }

// Worker is the application's worker.
func (s *Service) Worker() *worker.Worker { return s.worker }

// Failed delivers the first failure of the HTTP server or of a worker component:
// the service cannot do its job any more and should be stopped (and its process
// restarted by its supervisor).
func (s *Service) Failed() <-chan error {
	out := make(chan error, 1)
	go func() {
		select {
		case err := <-s.errs:
			out <- err
		case <-s.worker.Done():
			if err := s.worker.Err(); err != nil {
				out <- err
			}
		}
	}()
	return out
}

// Shutdown stops accepting requests, lets requests in flight finish, then stops the
// worker gracefully (in-flight batches commit and ack, the relay marks its batch).
// If ctx ends first it returns ctx's error; unacked messages are redelivered later,
// so nothing is lost either way. It returns a component failure, if one happened.
func (s *Service) Shutdown(ctx context.Context) error {
	herr := s.http.Shutdown(ctx)
	if s.metrics != nil {
		herr = errors.Join(herr, s.metrics.Shutdown(ctx))
	}
	s.served.Wait()
	werr := s.worker.Stop(ctx)
	return errors.Join(herr, werr)
}

// traced serves next inside an HTTP server span (otelhttp), continuing the
// caller's trace read with the global propagator, so the outbox rows the handler
// writes carry it on to the consumers. The span is named by its route (spanName),
// never by the raw path: a path holds ids, and span names must stay few.
func traced(tp trace.TracerProvider, next http.Handler) http.Handler {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return otelhttp.NewHandler(next, "http", otelhttp.WithTracerProvider(tp), otelhttp.WithSpanNameFormatter(spanName))
}

// spanName is the route that matched ("POST /v1/payments"; otelhttp asks again
// once the handler has run, when the route is known), or the method alone.
func spanName(_ string, r *http.Request) string {
	switch {
	case r.Pattern == "":
		return r.Method
	case strings.Contains(r.Pattern, " "):
		return r.Pattern
	default:
		return r.Method + " " + r.Pattern
	}
}
