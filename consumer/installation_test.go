package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/installation"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// records keeps every log record, for tests that check what was logged and at
// which level.
type records struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recs = append(r.recs, rec)
	return nil
}
func (r *records) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *records) WithGroup(string) slog.Handler      { return r }

// level is the level of the first record whose message contains msg, and whether
// there is one.
func (r *records) level(msg string) (slog.Level, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rec := range r.recs {
		if strings.Contains(rec.Message, msg) {
			return rec.Level, true
		}
	}
	return 0, false
}

// recorded is what the durable name records of its installation.
func recorded(t *testing.T, env *testenv.Env, name string) installation.Recorded {
	t.Helper()
	jc, err := env.JS.Consumer(context.Background(), testenv.Stream, name)
	if err != nil {
		t.Fatalf("durable %s: %v", name, err)
	}
	return installation.FromMetadata(jc.CachedInfo().Config.Metadata)
}

func stateOf(t *testing.T, pool *pgxpool.Pool) installation.State {
	t.Helper()
	st, err := installation.Load(context.Background(), pool, "")
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// bindOnce runs a consumer of inst until it has bound its durable (the durable
// records the database's epoch), then stops it.
func bindOnce(t *testing.T, env *testenv.Env, inst *install.Installation, name string) installation.State {
	t.Helper()
	before := stateOf(t, inst.Pool())
	c, err := consumer.New(inst, testenv.ConsumerConfig(name))
	if err != nil {
		t.Fatal(err)
	}
	stop := testenv.Go(t, "consumer "+name, c.Run)
	defer stop()
	testenv.Eventually(t, 10*time.Second, "the durable bound", func() bool {
		jc, err := env.JS.Consumer(context.Background(), testenv.Stream, name)
		if err != nil {
			return false
		}
		r := installation.FromMetadata(jc.CachedInfo().Config.Metadata)
		return r.Token == before.Token && r.Epoch > before.Epoch
	})
	return stateOf(t, inst.Pool())
}

// runRefused runs a consumer of inst that must refuse to start, and returns its
// error.
func runRefused(t *testing.T, inst *install.Installation, name string) error {
	t.Helper()
	c, err := consumer.New(inst, testenv.ConsumerConfig(name))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = c.Run(ctx)
	if err == nil {
		t.Fatalf("consumer %s started (or did not refuse within 20s)", name)
	}
	return err
}

// copyOf makes another database holding src's installation row as it is now: what
// a restored backup, a snapshot or a dump carries.
func copyOf(t *testing.T, env *testenv.Env, st installation.State) *install.Installation {
	t.Helper()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(context.Background(), `UPDATE idem_installation SET token = $1::uuid, epoch = $2, bound_by = NULLIF($3, '')::uuid`, st.Token, st.Epoch, st.Binding); err != nil {
		t.Fatal(err)
	}
	inst, err := install.New(db.Pool, env.NC, install.Config{Stream: env.Inst.Stream()})
	if err != nil {
		t.Fatal(err)
	}
	return inst
}

// A copy of the database taken before the original bound its durable again (a
// restored base backup or snapshot: it carries the token) is behind the durable,
// and refuses to bind it, saying what happened and what to do; the refusal changes
// nothing, so restarting it refuses again, and the original keeps binding.
func TestAForkedDatabaseIsRefused(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	first := bindOnce(t, env, env.Inst, "fork")
	cp := copyOf(t, env, first)
	bindOnce(t, env, env.Inst, "fork") // the original restarts

	for range 2 {
		err := runRefused(t, cp, "fork")
		if !errors.Is(err, consumer.ErrForkedDatabase) || !strings.Contains(err.Error(), "worker installation adopt "+first.Token) {
			t.Fatalf("the copy's consumer: %v; want ErrForkedDatabase naming `worker installation adopt TOKEN`", err)
		}
	}
	if got := stateOf(t, cp.Pool()); got != first {
		t.Errorf("the copy's row after its refusals = %+v, want %+v unchanged", got, first)
	}
	bindOnce(t, env, env.Inst, "fork") // the original again: never behind

	// The copy made the one to keep (the original retired): adopt the durable's
	// epoch, and it binds.
	r := recorded(t, env, "fork")
	if _, err := installation.Adopt(context.Background(), cp.Pool(), "", r.Token, r.Epoch); err != nil {
		t.Fatal(err)
	}
	bindOnce(t, env, cp, "fork")
}

// A copy taken while the original runs, both binding afterwards: whichever binds
// second after the copy is refused.
func TestTheSecondBinderAfterACopyIsRefused(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	first := bindOnce(t, env, env.Inst, "fork")
	cp := copyOf(t, env, first)
	bindOnce(t, env, cp, "fork") // the copy binds first
	if err := runRefused(t, env.Inst, "fork"); !errors.Is(err, consumer.ErrForkedDatabase) {
		t.Fatalf("the original after its copy bound: %v; want ErrForkedDatabase", err)
	}
}

// Binders of one database never refuse each other, however their bindings
// interleave: each one's epoch is its own, and none is behind what another wrote.
func TestConcurrentBindersOfOneDatabase(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for range 8 {
		wg.Go(func() {
			for range 5 {
				logs := &records{}
				inst := env.Install(t, func(c *install.Config) { c.Logger = slog.New(logs) })
				c, err := consumer.New(inst, testenv.ConsumerConfig("shared"))
				if err != nil {
					errs <- err
					return
				}
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan error, 1)
				go func() { done <- c.Run(ctx) }()
				waitStarted(logs, done)
				cancel()
				if err := <-done; err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("a binder of the same database: %v", err)
	}
}

// waitStarted waits until a consumer logging to logs has bound its durable, or
// its Run has returned.
func waitStarted(logs *records, done chan error) {
	for {
		if _, ok := logs.level("consumer started"); ok {
			return
		}
		select {
		case err := <-done:
			done <- err
			return
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// A moved database (here a rename; pg_upgrade and a dump and restore likewise)
// keeps its token, and binds its durables: the old name, cluster/database/schema,
// changed, and only the record of it follows.
func TestARenamedDatabaseKeepsItsDurables(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	bindOnce(t, env, env.Inst, "moved")
	oldID := recorded(t, env, "moved").ID

	env.DB.Pool.Reset()
	admin, err := pgx.Connect(context.Background(), pgtest.AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	renamed := env.DB.Name + "_r"
	rename := func(from, to string) {
		if _, err := admin.Exec(context.Background(), fmt.Sprintf("ALTER DATABASE %s RENAME TO %s", from, to)); err != nil {
			t.Fatal(err)
		}
	}
	rename(env.DB.Name, renamed)
	defer rename(renamed, env.DB.Name) // for the cleanup's drop
	cfg, err := pgxpool.ParseConfig(strings.Replace(env.DB.URL, "/"+env.DB.Name, "/"+renamed, 1))
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close() // before the rename back
	inst, err := install.New(pool, env.NC, install.Config{Stream: env.Inst.Stream()})
	if err != nil {
		t.Fatal(err)
	}
	bindOnce(t, env, inst, "moved")
	if id := recorded(t, env, "moved").ID; id == oldID || !strings.HasSuffix(id, "/"+renamed+"/public") {
		t.Errorf("the durable's old-style record = %q, want the new name (was %q)", id, oldID)
	}
}

// createDurable makes the durable name by hand, with metadata md.
func createDurable(t *testing.T, env *testenv.Env, name string, md map[string]string) {
	t.Helper()
	c, err := consumer.New(env.Inst, testenv.ConsumerConfig(name))
	if err != nil {
		t.Fatal(err)
	}
	cfg := c.JetStreamConfig()
	cfg.Metadata = md
	cfg.DeliverPolicy = jetstream.DeliverAllPolicy
	if _, err := env.JS.CreateConsumer(context.Background(), testenv.Stream, cfg); err != nil {
		t.Fatal(err)
	}
}

// A durable bound before tokens records the installation's old-style name: one
// that names this database is adopted quietly and restamped with the token; one
// that names nothing (its metadata removed, made by hand) is adopted too, but
// logged as an error, since any installation would have adopted it.
func TestDurablesBoundBeforeTokensAreAdopted(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	logs := &records{}
	inst := env.Install(t, func(c *install.Config) { c.Logger = slog.New(logs) })
	id, err := inst.Identify(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	createDurable(t, env, "old", map[string]string{installation.MetadataKey: id})
	createDurable(t, env, "bare", nil)
	bindOnce(t, env, inst, "old")
	bindOnce(t, env, inst, "bare")
	st := stateOf(t, env.DB.Pool)
	for _, name := range []string{"old", "bare"} {
		if r := recorded(t, env, name); r.Token != st.Token || r.ID != id {
			t.Errorf("durable %s records %+v, want token %s and %s", name, r, st.Token, id)
		}
	}
	if lvl, ok := logs.level("bound before installation tokens"); !ok || lvl != slog.LevelInfo {
		t.Errorf("adopting the old-style durable: logged %v (found %v), want INFO", lvl, ok)
	}
	if lvl, ok := logs.level("names no installation"); !ok || lvl != slog.LevelError {
		t.Errorf("adopting the durable with no metadata: logged %v (found %v), want ERROR", lvl, ok)
	}
}

// A durable of another installation (another token) is refused as before, and the
// refusal says how to move: adopt its token.
func TestAnotherInstallationsDurableNamesTheWayToMove(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	bindOnce(t, env, env.Inst, "theirs")
	r := recorded(t, env, "theirs")
	other := pgtest.New(t)
	inst, err := install.New(other.Pool, env.NC, install.Config{Stream: env.Inst.Stream()})
	if err != nil {
		t.Fatal(err)
	}
	err = runRefused(t, inst, "theirs")
	want := fmt.Sprintf("worker installation adopt %s --epoch %d", r.Token, r.Epoch)
	if !errors.Is(err, consumer.ErrForeignDurable) || !strings.Contains(err.Error(), want) {
		t.Fatalf("another installation's consumer: %v; want ErrForeignDurable saying %q", err, want)
	}
	if _, err := installation.Adopt(context.Background(), other.Pool, "", r.Token, r.Epoch); err != nil {
		t.Fatal(err)
	}
	bindOnce(t, env, inst, "theirs")
}

// A copy that binds while the original runs: the original, which will not bind
// again until it restarts, finds the durable ahead of its database at its next
// check and stops with ErrForkedDatabase, so that the two do not split the
// durable's messages for longer than that.
func TestARunningOriginalStopsWhenACopyBindsAfterIt(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	done := runOriginal(t, env, "fork")
	cp := copyOf(t, env, stateOf(t, env.DB.Pool))
	bindOnce(t, env, cp, "fork")
	wantForked(t, done, "the running original kept running after its copy bound the durable")
}

// runOriginal runs a consumer of env's installation that checks its durable
// every 50ms, until it has bound it (a new epoch), and returns what Run returns.
func runOriginal(t *testing.T, env *testenv.Env, name string) <-chan error {
	t.Helper()
	before := stateOf(t, env.DB.Pool)
	cfg := testenv.ConsumerConfig(name)
	cfg.CheckInterval = 50 * time.Millisecond
	c, err := consumer.New(env.Inst, cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { done <- c.Run(ctx) }()
	testenv.Eventually(t, 10*time.Second, "the original bound", func() bool {
		jc, err := env.JS.Consumer(context.Background(), testenv.Stream, name)
		return err == nil && installation.FromMetadata(jc.CachedInfo().Config.Metadata).Epoch > before.Epoch
	})
	return done
}

// wantForked waits for the running original's Run to return ErrForkedDatabase;
// stillRunning is the failure when it does not.
func wantForked(t *testing.T, done <-chan error, stillRunning string) {
	t.Helper()
	select {
	case err := <-done:
		if !errors.Is(err, consumer.ErrForkedDatabase) {
			t.Fatalf("the running original: Run = %v, want ErrForkedDatabase", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal(stillRunning)
	}
}

// A copy and its original binding at once: each bumps its own database from the
// epoch they share to the same next one, and the durable keeps whichever binding
// was written last, here the copy's. The epochs agree; the bindings do not, and
// the running original, whose database did not make the durable's binding, stops.
func TestACopyAndItsOriginalBindingAtOnce(t *testing.T) {
	t.Parallel()
	env := testenv.New(t)
	before := stateOf(t, env.DB.Pool)
	cp := copyOf(t, env, before) // taken before the original's binding below
	done := runOriginal(t, env, "race")

	// The copy's binding, begun when the durable still recorded the shared epoch.
	ctxb := context.Background()
	stCopy, ok, err := installation.Bump(ctxb, cp.Pool(), "", installation.Recorded{Token: before.Token, Epoch: before.Epoch, Binding: before.Binding})
	if err != nil || !ok {
		t.Fatalf("the copy's bump: %v, %v", ok, err)
	}
	if orig := stateOf(t, env.DB.Pool); stCopy.Epoch != orig.Epoch {
		t.Fatalf("the copy reached epoch %d, the original %d: the case needs them equal", stCopy.Epoch, orig.Epoch)
	}
	jc, err := env.JS.Consumer(ctxb, testenv.Stream, "race")
	if err != nil {
		t.Fatal(err)
	}
	dc := jc.CachedInfo().Config
	dc.Metadata = installation.Metadata(stCopy, dc.Metadata[installation.MetadataKey])
	if _, err := env.JS.UpdateConsumer(ctxb, testenv.Stream, dc); err != nil {
		t.Fatal(err)
	}
	wantForked(t, done, "the running original kept running beside a copy that bound the durable at the same epoch")
	// And it stays refused: its database's last binding is not the durable's.
	if err := runRefused(t, env.Inst, "race"); !errors.Is(err, consumer.ErrForkedDatabase) {
		t.Fatalf("the original restarted: %v, want ErrForkedDatabase", err)
	}
}
