package chaos

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/app/pgembed"
	"github.com/idemkit/idem/migrations"
)

// chaosDB is the run's database, on the run's own Postgres cluster: the checker's
// pool, and the URL the workers connect with.
type chaosDB struct {
	Pool *pgxpool.Pool
	URL  string
	Name string
}

// databaseName is the database every run creates in its own cluster.
const databaseName = "idem_chaos"

// maxConnections is the private cluster's max_connections: five workers with pools
// of 16, the checker's pool, and the connections of killed incarnations that the
// server has not noticed are gone yet. Postgres's default of 100 is too tight.
const maxConnections = 300

// privatePG is the run's own PostgreSQL cluster (internal/pgembed, the machine's
// binaries), so that the run can stop the server in the middle of the load and start
// it again without touching anybody else's databases.
type privatePG struct {
	cfg pgembed.Config
	log *os.File // pgembed's progress messages

	mu     sync.Mutex
	url    string // the cluster's admin URL (database postgres)
	stop   func(context.Context) error
	starts int
	back   chan struct{} // while restart has the server down: closed when it is back
}

// startPG creates and starts a fresh cluster in dir on port, raises its
// max_connections (a setting that needs a restart), creates the run's database
// and migrates idem's tables into it. A non-nil *privatePG is returned as soon
// as the server runs, also with an error: the caller stops it.
func startPG(ctx context.Context, ps *procs, dir string, port int) (*privatePG, *chaosDB, error) {
	if os.Geteuid() == 0 {
		// Postgres runs as the postgres user then (it refuses root), and that user
		// must be able to walk down to dir: the test's temp dir is created 0700.
		if err := os.Chmod(filepath.Dir(filepath.Dir(dir)), 0o711); err != nil {
			return nil, nil, fmt.Errorf("chaos: open the temp dir to the postgres user: %w", err)
		}
	}
	log, err := ps.openLog("postgres-embed")
	if err != nil {
		return nil, nil, err
	}
	p := &privatePG{log: log, cfg: pgembed.Config{
		Dir:    dir,
		Port:   port,
		Logger: slog.New(slog.NewTextHandler(log, nil)),
	}}
	// The server's own log, for the tails a failed run prints.
	ps.addLog(filepath.Join(dir, "postgres.log"))
	if err := p.start(ctx); err != nil {
		return nil, nil, err
	}
	// From here on the server runs: the caller stops it, also after an error.
	if _, err := p.exec(ctx, fmt.Sprintf("ALTER SYSTEM SET max_connections = %d", maxConnections)); err != nil {
		return p, nil, err
	}
	if err := p.restart(ctx, 0); err != nil {
		return p, nil, err
	}
	if _, err := p.exec(ctx, "CREATE DATABASE "+databaseName); err != nil {
		return p, nil, err
	}

	u, err := url.Parse(p.adminURL())
	if err != nil {
		return p, nil, fmt.Errorf("chaos: private Postgres URL: %w", err)
	}
	u.Path = "/" + databaseName
	db := &chaosDB{URL: u.String(), Name: databaseName}
	pcfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		return p, nil, fmt.Errorf("chaos: %w", err)
	}
	pcfg.MaxConns = 8
	pcfg.ConnConfig.RuntimeParams["application_name"] = "idem-chaos-checker"
	if db.Pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return p, nil, fmt.Errorf("chaos: open pool: %w", err)
	}
	if _, err := migrations.Apply(ctx, db.Pool, migrations.Config{}); err != nil {
		db.Pool.Close()
		return p, nil, fmt.Errorf("chaos: migrate: %w", err)
	}
	return p, db, nil
}

func (p *privatePG) adminURL() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.url
}

// start runs pgembed.Ensure: initdb the first time, then a start on the same
// directory and port.
func (p *privatePG) start(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer cancel()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.starts++
	fmt.Fprintf(p.log, "=== chaos: private Postgres start #%d\n", p.starts)
	u, stop, err := pgembed.Ensure(ctx, p.cfg)
	if err != nil {
		return fmt.Errorf("chaos: private Postgres: %w", err)
	}
	p.url, p.stop = u, stop
	return nil
}

// shutdown stops the server (pg_ctl stop -m fast: sessions are cut, open
// transactions roll back). It is harmless when the server is not running.
func (p *privatePG) shutdown(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer cancel()
	p.mu.Lock()
	stop := p.stop
	p.mu.Unlock()
	if stop == nil {
		return nil
	}
	fmt.Fprintf(p.log, "=== chaos: private Postgres stop\n")
	if err := stop(ctx); err != nil {
		return fmt.Errorf("chaos: stop private Postgres: %w", err)
	}
	return nil
}

// restart stops the server, keeps it down for down (the outage: part of the fault
// schedule, not a wait for some state) and starts it again on the same port and
// data. The restart happens even when ctx ends meanwhile: a run must never be left
// without its database.
func (p *privatePG) restart(ctx context.Context, down time.Duration) error {
	back := make(chan struct{})
	p.mu.Lock()
	p.back = back
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		p.back = nil
		p.mu.Unlock()
		close(back)
	}()
	if err := p.shutdown(ctx); err != nil {
		return err
	}
	if down > 0 {
		fmt.Fprintf(p.log, "=== chaos: private Postgres down for %s\n", down)
		select {
		case <-time.After(down):
		case <-ctx.Done():
		}
	}
	return p.start(ctx)
}

// whenUp returns when the server is not down for a restart (at once, mostly), or
// with ctx's error.
func (p *privatePG) whenUp(ctx context.Context) error {
	p.mu.Lock()
	back := p.back
	p.mu.Unlock()
	if back == nil {
		return nil
	}
	select {
	case <-back:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// exec runs one statement on the cluster's admin database.
func (p *privatePG) exec(ctx context.Context, sql string) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, p.adminURL())
	if err != nil {
		return 0, fmt.Errorf("chaos: %s: %w", sql, err)
	}
	defer pool.Close()
	tag, err := pool.Exec(ctx, sql)
	if err != nil {
		return 0, fmt.Errorf("chaos: %s: %w", sql, err)
	}
	return tag.RowsAffected(), nil
}

// retryDB runs fn until it succeeds, for up to a minute: the checker's own reads
// and writes during the load may fall into a database outage of the schedule, and
// must then wait for the database to come back like any client.
func (r *run) retryDB(ctx context.Context, what string, fn func(context.Context) error) error {
	deadline := time.Now().Add(time.Minute)
	for {
		err := fn(ctx)
		if err == nil || ctx.Err() != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: %w", what, err)
		}
		select { // the checker's back-off, like a client's
		case <-time.After(250 * time.Millisecond):
		case <-ctx.Done():
		}
	}
}
