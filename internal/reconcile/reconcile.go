package reconcile

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/installation"
	"github.com/idemkit/idem/internal/natssubject"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/registry"
	"github.com/idemkit/idem/internal/store"
)

// DefaultAfter is how long a published intent may stay unsettled before the
// reconciler looks for it in the stream (the worker's --reconcile-after).
const DefaultAfter = 5 * time.Minute

// Config tunes a Reconciler; the zero value of every field means its default.
type Config struct {
	// After is how long after its publish an unsettled row is judged (default
	// DefaultAfter): until then it is simply in flight. A lagging row is looked at
	// in the stream again one After later, not on every pass.
	After time.Duration
	// Interval between passes (default 30s, or After when shorter). Rows are
	// proven complete on every pass, so it is also how soon a settled row's
	// retention starts.
	Interval time.Duration
	// BatchSize is the most rows judged per transaction (default 500).
	BatchSize int
	// Retention is how long a completed or alerted row is kept as evidence before
	// the collector may delete it (default 72h).
	Retention time.Duration
	// UnroutedHorizon is how long a row no registered consumer reads is waited
	// for (a consumer may be deployed late) before it is given up on and
	// dead-lettered under the relay's name (default 72h).
	UnroutedHorizon time.Duration
	// Margin is subtracted, with the stream's MaxAge, from the shortest key
	// lifetime of the consumers that read a row, to make the horizon past which a
	// lost row is no longer re-driven but alerted (default 1h, at most a quarter
	// of the lifetime): a copy sent later could still be in the stream after a
	// reader's inbox forgot the key, and run its effect twice.
	Margin time.Duration
	// Trusted are subject filters whose rows are complete once published, as
	// before proof existed: for subjects read by consumers whose inbox lives in
	// another database (see docs/ARCHITECTURE.md, "Consumers in other
	// databases"), which the reconciler cannot see.
	Trusted []string
}

// Validate reports a configuration that cannot work.
func (c Config) Validate() error {
	for _, f := range c.Trusted {
		if err := natssubject.ValidateFilter(f); err != nil {
			return fmt.Errorf("reconcile: Trusted: %w", err)
		}
	}
	if c.After < 0 || c.Interval < 0 || c.Retention < 0 || c.UnroutedHorizon < 0 || c.Margin < 0 || c.BatchSize < 0 {
		return errors.New("reconcile: durations and BatchSize must not be negative")
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.After == 0 {
		c.After = DefaultAfter
	}
	if c.Interval == 0 {
		c.Interval = min(30*time.Second, c.After)
	}
	if c.BatchSize == 0 {
		c.BatchSize = 500
	}
	if c.Retention == 0 {
		c.Retention = 72 * time.Hour
	}
	if c.UnroutedHorizon == 0 {
		c.UnroutedHorizon = 72 * time.Hour
	}
	if c.Margin == 0 {
		c.Margin = time.Hour
	}
	return c
}

// Reconciler proves published intents complete and re-drives what the stream lost;
// see the package documentation.
type Reconciler struct {
	inst    parts.Installation
	pool    *pgxpool.Pool
	js      jetstream.JetStream
	cfg     Config
	stream  string // the installation's: rows the relay published elsewhere are not this reconciler's
	log     *slog.Logger
	observe idem.Observer
	st      *store.Store
}

// New returns a reconciler of an installation's published rows (its parts,
// parts.Of). It does not touch the database or the broker until Run or Pass.
func New(inst parts.Installation, cfg Config) (*Reconciler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if inst.JS == nil {
		return nil, errors.New("reconcile: the installation has no NATS connection")
	}
	cfg = cfg.withDefaults()
	return &Reconciler{inst: inst, pool: inst.Pool, js: inst.JS, cfg: cfg, stream: inst.Stream,
		log: inst.Logger.With("component", "reconciler"), observe: inst.Observer, st: inst.Store}, nil
}

// Config returns the configuration with defaults filled in.
func (r *Reconciler) Config() Config { return r.cfg }

// Run makes a pass every Interval until ctx ends. A failed pass (the database or
// the broker is down) is logged and tried again at the next interval: nothing is
// lost by waiting, the rows stay unproven.
func (r *Reconciler) Run(ctx context.Context) error {
	r.log.InfoContext(ctx, "reconciler started", "stream", r.stream, "after", r.cfg.After, "interval", r.cfg.Interval)
	t := time.NewTicker(r.cfg.Interval)
	defer t.Stop()
	for {
		_, err := r.Pass(ctx)
		switch {
		case err == nil, ctx.Err() != nil:
		case errors.Is(err, ErrSchemaAhead):
			r.log.ErrorContext(ctx, "reconciler standing down: a newer release of idem migrated the schema, and its reconcilers judge the rows; checking again next interval", "err", err)
		default:
			r.log.WarnContext(ctx, "reconcile pass failed; trying again next interval", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// ErrSchemaAhead is wrapped by Pass's error on a schema a newer release of idem
// migrated: that release's reconcilers judge the rows, since they may address
// re-drives in ways this one does not know.
var ErrSchemaAhead = errors.New("reconcile: schema migrated by a newer release")

// Report counts what one pass did.
type Report struct {
	// Checked rows: published and not yet proven when the pass began.
	Checked int
	// Completed, Lagging, Unrouted, Redriven and Alerted are the verdicts (see the
	// Outcome constants); rows younger than After and still unsettled get none.
	Completed, Lagging, Unrouted, Redriven, Alerted int
}

func (p *Report) add(q Report) {
	p.Checked += q.Checked
	p.Completed += q.Completed
	p.Lagging += q.Lagging
	p.Unrouted += q.Unrouted
	p.Redriven += q.Redriven
	p.Alerted += q.Alerted
}

// Pass judges every unproven row of the stream once, a batch per transaction, and
// returns what it did. On a schema a newer release migrated it does nothing and
// returns an error wrapping ErrSchemaAhead.
func (r *Reconciler) Pass(ctx context.Context) (Report, error) {
	var total Report
	applied, known, err := r.inst.SchemaVersions(ctx)
	if err != nil {
		return total, fmt.Errorf("reconcile: %w", err)
	}
	if applied > known {
		return total, fmt.Errorf("%w: schema %s is at version %d, and this build knows up to %d: upgrade this process",
			ErrSchemaAhead, r.inst.Schema, applied, known)
	}
	consumers, err := registry.Registered(ctx, r.pool, r.inst.Schema)
	if err != nil {
		return total, err
	}
	install, err := r.inst.Identify(ctx)
	if err != nil {
		return total, err
	}
	// The polling relay's published rows, then the log relay's windows.
	for _, load := range []loader{r.loadPolled, r.loadLogged} {
		var after int64
		for {
			// The stream's state is read afresh for each batch: a row re-published
			// since the last read must not look beyond the stream's end.
			s := &streamView{js: r.js, name: r.stream, installation: install, anyInstallation: faults.From(ctx).On(faults.AnyInstallation),
				own: func(ctx context.Context) (installation.State, error) {
					return installation.Load(ctx, r.pool, r.inst.Schema)
				}}
			rep, last, err := r.batch(ctx, consumers, s, load, after)
			total.add(rep)
			if err != nil {
				return total, err
			}
			if last == 0 {
				break
			}
			after = last
		}
	}
	for outcome, n := range map[idem.Outcome]int{idem.OutcomeCompleted: total.Completed, idem.OutcomeLagging: total.Lagging,
		idem.OutcomeUnrouted: total.Unrouted, idem.OutcomeRedriven: total.Redriven, idem.OutcomeAlerted: total.Alerted} {
		if n > 0 {
			r.observe.Observe(idem.Event{Component: idem.ComponentReconciler, Outcome: outcome, Count: n})
		}
	}
	if total.Redriven > 0 {
		r.log.WarnContext(ctx, "reconcile: re-drove intents the stream lost", "rows", total.Redriven)
	}
	return total, nil
}

// unproven is one row the pass judges.
type unproven struct {
	id                int64
	key, subject      string
	message           string // wire.MessageOf its subject and name
	msgID, replayFor  string
	seq               int64
	generation        int
	written           time.Time           // created_at
	age               time.Duration       // since created, by the database's clock
	due               bool                // published at least After ago
	lookInStream      bool                // not looked for in the stream for After
	expected, missing []registry.Consumer // who should settle it; who has not
	readers           []registry.Consumer // who reads it, named by its Idem-Replay-For or not
	window            int64               // the log relay's window that holds it (0: the polling relay's row)
}

// A loader loads, in tx, the next batch of rows to judge: those after the cursor
// after, with the cursor the next batch starts from (0: none left), and the log
// relay's windows the batch covers (whose rows, all of them, it loaded).
type loader func(ctx context.Context, tx pgx.Tx, after int64) (rows []*unproven, next int64, windows []int64, err error)

// batch judges the next batch load gives, in one transaction, and returns the
// cursor of the next (0 when there was none).
func (r *Reconciler) batch(ctx context.Context, consumers []registry.Consumer, s *streamView, load loader, after int64) (Report, int64, error) {
	var rep Report
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return rep, 0, fmt.Errorf("reconcile: begin: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit

	rows, next, windows, err := load(ctx, tx, after)
	if err != nil || next == 0 {
		return rep, 0, err
	}
	rep.Checked = len(rows)
	if err := r.settle(ctx, tx, consumers, rows); err != nil {
		return rep, 0, err
	}

	var complete, lag, unrouted []int64
	var redriveIDs []int64
	var redriveFor []string
	var alertIDs []int64
	var alertFor, alertWhy []string
	var alertHorizon []time.Duration
	for _, u := range rows {
		switch {
		case natssubject.Under(r.cfg.Trusted, u.subject):
			complete = append(complete, u.id)
			continue
		case len(u.expected) > 0 && len(u.missing) == 0:
			complete = append(complete, u.id)
			continue
		case !u.due:
			continue // in flight
		case len(u.expected) == 0:
			if u.age >= r.cfg.UnroutedHorizon {
				alertIDs, alertFor, alertHorizon = append(alertIDs, u.id), append(alertFor, store.RelayConsumer), append(alertHorizon, 0)
				alertWhy = append(alertWhy, fmt.Sprintf("reconcile: no registered consumer reads %s on stream %s; waited %s", u.subject, r.stream, r.cfg.UnroutedHorizon))
				continue
			}
			unrouted = append(unrouted, u.id)
			continue
		}
		if !u.lookInStream {
			continue // looked at lately: still lagging
		}
		gone, why, err := s.lost(ctx, u)
		if err != nil {
			return rep, 0, err
		}
		if !gone {
			lag = append(lag, u.id)
			continue
		}
		maxAge, known, err := s.maxAge(ctx)
		if err != nil {
			return rep, 0, err
		}
		if !known {
			continue // no stream to re-drive to yet: the next pass judges it
		}
		if horizon, ok := r.redriveHorizon(ctx, u, maxAge); !ok || u.age >= horizon {
			for _, c := range u.missing {
				alertIDs, alertFor, alertHorizon = append(alertIDs, u.id), append(alertFor, c.Name), append(alertHorizon, c.KeyLifetime)
				alertWhy = append(alertWhy, fmt.Sprintf("reconcile: published but never settled by %s, and lost by the stream (%s); a copy sent now could outlive "+
					"the key lifetime of a consumer of %s, which would then run the effect twice", c.Name, why, u.subject))
			}
			continue
		}
		for _, c := range u.missing {
			redriveIDs, redriveFor = append(redriveIDs, u.id), append(redriveFor, c.Name)
		}
		r.log.DebugContext(ctx, "reconcile: lost by the stream; re-driving", "key", u.key, "subject", u.subject, "seq", u.seq, "why", why)
	}

	if len(complete) > 0 {
		if _, err := tx.Exec(ctx, r.st.Outbox.Complete, complete, r.cfg.Retention); err != nil {
			return rep, 0, fmt.Errorf("reconcile: complete: %w", err)
		}
	}
	for verdict, ids := range map[string][]int64{"lag": lag, "unrouted": unrouted} {
		if len(ids) > 0 {
			if _, err := tx.Exec(ctx, r.st.Outbox.Verdict, ids, verdict); err != nil {
				return rep, 0, fmt.Errorf("reconcile: mark %s: %w", verdict, err)
			}
		}
	}
	// The rows re-driven: those of redriveIDs the re-drive found still unsettled
	// when it ran. One a consumer settled meanwhile is left for the next pass.
	var redrivenIDs []int64
	if len(redriveIDs) > 0 {
		fs := faults.From(ctx)
		if err := fs.Hit(ctx, faults.ReconcileBeforeRedrive, nil); err != nil {
			return rep, 0, fmt.Errorf("reconcile: re-drive: %w", err)
		}
		rs, err := tx.Query(ctx, r.st.Outbox.Redrive, redriveIDs, redriveFor, "reconcile: the stream lost it; re-driven",
			fs.On(faults.RedriveToAll), fs.On(faults.OldDeadLettersProve))
		if err != nil {
			return rep, 0, fmt.Errorf("reconcile: re-drive: %w", err)
		}
		if redrivenIDs, err = pgx.CollectRows(rs, pgx.RowTo[int64]); err != nil {
			return rep, 0, fmt.Errorf("reconcile: re-drive: %w", err)
		}
		if len(redrivenIDs) > 0 {
			if _, err := tx.Exec(ctx, r.st.Outbox.Notify, r.st.Outbox.Channel); err != nil {
				return rep, 0, fmt.Errorf("reconcile: re-drive: notify: %w", err)
			}
		}
	}
	if len(alertIDs) > 0 {
		if _, err := tx.Exec(ctx, r.st.DeadLetters.InsertAlert, alertIDs, alertFor, alertWhy, alertHorizon, r.cfg.Retention); err != nil {
			return rep, 0, fmt.Errorf("reconcile: alert: %w", err)
		}
	}
	if proven := provenWindows(windows, rows, complete, redrivenIDs, alertIDs); len(proven) > 0 {
		if _, err := tx.Exec(ctx, r.st.Published.Prove, proven); err != nil {
			return rep, 0, fmt.Errorf("reconcile: prove windows: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return rep, 0, fmt.Errorf("reconcile: commit: %w", err)
	}
	for i, id := range alertIDs {
		if i == 0 || alertIDs[i-1] != id {
			r.log.ErrorContext(ctx, "reconcile: an intent was never settled and is past every horizon; dead-lettered", "outbox_id", id, "consumer", alertFor[i], "reason", alertWhy[i])
		}
	}
	rep.Completed, rep.Lagging, rep.Unrouted, rep.Redriven = len(complete), len(lag), len(unrouted), len(redrivenIDs)
	rep.Alerted = countDistinct(alertIDs)
	return rep, next, nil
}

// provenWindows are the windows none of whose rows is left to judge: every row
// loaded for them was proven complete, re-driven (the polling relay's from now
// on) or given up on.
func provenWindows(windows []int64, rows []*unproven, done ...[]int64) []int64 {
	if len(windows) == 0 {
		return nil
	}
	settled := map[int64]bool{}
	for _, ids := range done {
		for _, id := range ids {
			settled[id] = true
		}
	}
	open := map[int64]bool{}
	for _, u := range rows {
		if !settled[u.id] {
			open[u.window] = true
		}
	}
	var proven []int64
	for _, w := range windows {
		if !open[w] {
			proven = append(proven, w)
		}
	}
	return proven
}

// loadPolled loads the polling relay's published, unproven rows after the id
// after, BatchSize of them; the next cursor is the last one's id.
func (r *Reconciler) loadPolled(ctx context.Context, tx pgx.Tx, after int64) ([]*unproven, int64, []int64, error) {
	rs, err := tx.Query(ctx, r.st.Outbox.Unproven, r.stream, after, r.cfg.After, r.cfg.BatchSize)
	if err != nil {
		return nil, 0, nil, fmt.Errorf("reconcile: load: %w", err)
	}
	out, err := pgx.CollectRows(rs, func(row pgx.CollectableRow) (*unproven, error) {
		u := &unproven{}
		var age float64
		err := row.Scan(&u.id, &u.key, &u.subject, &u.message, &u.msgID, &u.replayFor, &u.seq, &u.generation, &u.written, &age, &u.due, &u.lookInStream)
		u.age = time.Duration(age * float64(time.Second))
		return u, err
	})
	if err != nil {
		return nil, 0, nil, fmt.Errorf("reconcile: load: %w", err)
	}
	if len(out) == 0 {
		return nil, 0, nil, nil
	}
	return out, out[len(out)-1].id, nil, nil
}

// windowsPerBatch is how many of the log relay's windows one batch judges: a
// window holds at most the relay's BatchSize rows.
const windowsPerBatch = 4

// loadLogged loads the log relay's unproven windows after the window after, and
// their rows still to judge; the next cursor is the last window's id.
func (r *Reconciler) loadLogged(ctx context.Context, tx pgx.Tx, after int64) ([]*unproven, int64, []int64, error) {
	rs, err := tx.Query(ctx, r.st.Published.Unproven, r.stream, after, windowsPerBatch)
	if err != nil {
		return nil, 0, nil, fmt.Errorf("reconcile: load windows: %w", err)
	}
	windows, err := pgx.CollectRows(rs, pgx.RowTo[int64])
	if err != nil {
		return nil, 0, nil, fmt.Errorf("reconcile: load windows: %w", err)
	}
	if len(windows) == 0 {
		return nil, 0, nil, nil
	}
	rs, err = tx.Query(ctx, r.st.Published.Rows, windows, r.cfg.After)
	if err != nil {
		return nil, 0, nil, fmt.Errorf("reconcile: load: %w", err)
	}
	out, err := pgx.CollectRows(rs, func(row pgx.CollectableRow) (*unproven, error) {
		u := &unproven{}
		var age float64
		err := row.Scan(&u.id, &u.key, &u.subject, &u.message, &u.msgID, &u.replayFor, &u.seq, &u.generation, &u.written, &age, &u.due, &u.lookInStream, &u.window)
		u.age = time.Duration(age * float64(time.Second))
		return u, err
	})
	if err != nil {
		return nil, 0, nil, fmt.Errorf("reconcile: load: %w", err)
	}
	return out, windows[len(windows)-1], windows, nil
}

// settle fills each row's expected and missing consumers: who should see it, and
// who has not settled it.
func (r *Reconciler) settle(ctx context.Context, tx pgx.Tx, consumers []registry.Consumer, rows []*unproven) error {
	var names, keys, messages []string
	var written []time.Time
	var ids []int64
	for _, u := range rows {
		u.expected = registry.Expected(consumers, r.stream, u.subject, u.replayFor, u.written)
		u.readers = registry.Expected(consumers, r.stream, u.subject, "", u.written)
		for _, c := range u.expected {
			names, keys, messages = append(names, c.Name), append(keys, u.key), append(messages, u.message)
			written, ids = append(written, u.written), append(ids, u.id)
		}
	}
	type pair struct {
		consumer string
		id       int64
	}
	settled := map[pair]bool{}
	if len(names) > 0 {
		fs := faults.From(ctx)
		rs, err := tx.Query(ctx, r.st.Inbox.Settled, names, keys, messages, written, ids, fs.On(faults.RedriveToAll), fs.On(faults.OldDeadLettersProve))
		if err != nil {
			return fmt.Errorf("reconcile: proof: %w", err)
		}
		pairs, err := pgx.CollectRows(rs, func(row pgx.CollectableRow) (pair, error) {
			var p pair
			err := row.Scan(&p.consumer, &p.id)
			return p, err
		})
		if err != nil {
			return fmt.Errorf("reconcile: proof: %w", err)
		}
		for _, p := range pairs {
			settled[p] = true
		}
	}
	for _, u := range rows {
		for _, c := range u.expected {
			if !settled[pair{c.Name, u.id}] {
				u.missing = append(u.missing, c)
			}
		}
	}
	return nil
}

// redriveHorizon is the age of a row past which a copy of it could outlive the
// memory of a consumer that reads it: the copy stays in the stream for up to
// maxAge after it is published, and every consumer that reads the row — settled
// ones and those its Idem-Replay-For leaves out included, since one that does not
// honour the header would run the copy — may forget the key its lifetime after
// the row was written (less a margin, for the relay's delay). That lifetime is
// the one the consumer's settlement was written under (SettledLifetime), not a
// longer one it registered since. ok is false when no copy is ever safe: the
// stream keeps messages forever (maxAge 0).
func (r *Reconciler) redriveHorizon(ctx context.Context, u *unproven, maxAge time.Duration) (horizon time.Duration, ok bool) {
	fs := faults.From(ctx)
	if fs.On(faults.RedriveToAll) {
		// The negative control: the missing consumers' own lifetimes, as if no
		// copy could outlive a key.
		for i, c := range u.missing {
			if h := c.KeyLifetime - min(r.cfg.Margin, c.KeyLifetime/4); i == 0 || h < horizon {
				horizon = h
			}
		}
		return horizon, true
	}
	if maxAge <= 0 {
		return 0, false
	}
	for i, c := range u.readers {
		lifetime := c.SettledLifetime(u.written)
		if fs.On(faults.RegisteredLifetime) {
			lifetime = c.KeyLifetime // the negative control: today's lifetime
		}
		margin := min(r.cfg.Margin, lifetime/4)
		if h := lifetime - maxAge - margin; i == 0 || h < horizon {
			horizon = h
		}
	}
	return horizon, true
}

func countDistinct(sortedIDs []int64) int {
	n := 0
	for i, id := range sortedIDs {
		if i == 0 || sortedIDs[i-1] != id {
			n++
		}
	}
	return n
}
