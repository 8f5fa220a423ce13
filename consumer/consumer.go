package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/installation"
	"github.com/idemkit/idem/internal/otelmsg"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/registry"
	"github.com/idemkit/idem/internal/store"
)

// Consumer runs a handler over a durable JetStream pull consumer, exactly once per
// key; see the package documentation. One engine serves both kinds of handler: the
// pull loop, the acks, the retries and the dead letters are the same, only the
// step between "delivered" and "settled" differs (one transaction for a batch, or
// a lease around one external effect).
type Consumer struct {
	inst     *install.Installation
	pool     *pgxpool.Pool
	js       jetstream.JetStream
	cfg      Config
	stream   string // the installation's
	log      *slog.Logger
	tracer   trace.Tracer
	observer idem.Observer
	inbox    *dedupe.Inbox
	st       *store.Store
	batch    BatchHandler // the in-transaction handler, nil for External

	attempts *attemptCounter
	// stopping is closed when Run's context ends: work held while the database is
	// down is handed back then.
	stopping <-chan struct{}
	// health is what keeps the consumer from receiving messages, or nil.
	health atomic.Pointer[error]
	// keyOnly, anyInstallation and ignoreEpoch are the negative controls of a
	// delivery's identity (faults.KeyOnlyIdentity, faults.AnyInstallation,
	// faults.IgnoreEpoch), renameBackfills that of a likely rename
	// (faults.RenameBackfills), read at Run.
	keyOnly, anyInstallation, ignoreEpoch, renameBackfills bool
	// recordOnWork is the negative control of the hard stop
	// (faults.RecordOnWorkContext), read at Run.
	recordOnWork bool

	// registered is the registration Register made, for Run to start from.
	regMu      sync.Mutex
	registered *binding
}

// New returns a consumer of inst: it reads inst's stream, claims in inst's inbox,
// and logs, traces and reports its events through inst. It does not touch the
// broker until Run.
func New(inst *install.Installation, cfg Config) (*Consumer, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if inst.JetStream() == nil {
		return nil, fmt.Errorf("consumer %s: the installation has no NATS connection", cfg.Name)
	}
	cfg = cfg.WithDefaults()
	c := &Consumer{
		inst: inst, pool: inst.Pool(), js: inst.JetStream(), cfg: cfg, stream: inst.Stream().Name,
		inbox: dedupe.New(inst), st: parts.Of(inst).Store, observer: inst.Observer(),
		log:    inst.Logger().With("consumer", cfg.Name, "subject", cfg.Subject),
		tracer: otelmsg.Tracer(inst.TracerProvider()),
	}
	c.attempts = &attemptCounter{pool: c.pool, consumer: cfg.Name, lifetime: cfg.KeyLifetime, q: c.st.Attempts}
	switch {
	case cfg.BatchHandler != nil:
		c.batch = cfg.BatchHandler
	case cfg.Handler != nil:
		c.batch = singleAsBatch{cfg.Handler}
	}
	return c, nil
}

// Config returns the consumer's configuration with defaults filled in.
func (c *Consumer) Config() Config { return c.cfg }

// JetStreamConfig is the durable consumer this Consumer creates or updates, as far
// as its configuration says: where a new durable starts, and the installation it
// belongs to, are added when it is bound (see Run).
func (c *Consumer) JetStreamConfig() jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       c.cfg.Name,
		FilterSubject: c.cfg.Subject,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       c.cfg.AckWait,
		// The broker never gives up on a message by itself: a message it stopped
		// delivering would vanish without a trace. The consumer counts attempts
		// and dead-letters past MaxDeliver instead.
		MaxDeliver:    -1,
		MaxAckPending: c.cfg.maxAckPending,
	}
}

// Run consumes until ctx is cancelled, then stops fetching, finishes the work
// already started (commit or complete, then ack) and returns nil. Messages received
// but not started are handed straight back to the broker.
//
// Before the first message it registers the consumer in the installation (the
// reconciler then expects it to settle what it reads; see Rename and Forget) and
// binds its durable JetStream consumer: one that belongs to another installation
// (another token, as its metadata records) is refused with ErrForeignDurable, since
// two installations sharing a durable split its messages between their inboxes;
// one that a copy of this database bound since (an epoch ahead of this
// database's) is refused with ErrForkedDatabase, at the start and, while Run
// runs, at every check of the durable (Config.CheckInterval), when Run returns
// that error. A consumer new to the installation that looks like a rename of a
// registered one is refused with ErrLikelyRenamed, unregistered and without a
// durable (see Config.Start).
//
// When ctx ends Run stops taking messages and finishes those in flight on a
// context that outlives ctx: a consumer run this way has no hard stop. RunWork
// gives it one.
func (c *Consumer) Run(ctx context.Context) error {
	return c.RunWork(ctx, context.WithoutCancel(ctx))
}

// RunWork is Run with the work context work, what the handlers run on: when ctx
// ends (the soft stop) the consumer takes no more messages and lets those in
// flight finish; when work ends (the hard stop) their handlers' contexts are
// cancelled, so an in-transaction batch rolls back and an external effect is
// abandoned, and their messages are redelivered later, as after a crash. An
// external effect whose Perform returns success after the hard stop is still
// recorded (its lease holds it until then). RunWork returns once the work in
// flight has returned. worker.Worker.Stop is this, for every component at once.
func (c *Consumer) RunWork(ctx, work context.Context) error {
	c.stopping = ctx.Done()
	c.readFaults(ctx)
	// Stopped while starting (registering, creating the durable consumer): a
	// stop, not a failure.
	b, err := c.registration(ctx)
	if errors.Is(err, ErrLikelyRenamed) {
		return err
	}
	if err != nil {
		return nil // stopped while starting: a stop, not a failure
	}
	jc, err := c.createDurable(ctx, b)
	if ctx.Err() != nil {
		return nil
	}
	if err != nil {
		return err
	}
	// The queue holds about what the workers can start soon: BatchSize per worker,
	// and no more bytes than MaxBufferedBytes; the pulls ask for no more bytes
	// than that either.
	maxBuffered := c.cfg.MaxBufferedBytes
	if mp := c.js.Conn().MaxPayload(); maxBuffered < mp {
		maxBuffered = mp // a smaller pull could never fetch the biggest message
	}
	q := newQueue(c.cfg.BatchSize*c.cfg.Concurrency, maxBuffered)
	f := &fetcher{c: c, q: q, maxBytes: int(maxBuffered), binding: b}
	if err := f.start(ctx, jc); err != nil {
		return err
	}
	c.log.InfoContext(ctx, "consumer started", "stream", c.stream, "external", c.cfg.External != nil,
		"batch_size", c.cfg.BatchSize, "concurrency", c.cfg.Concurrency)
	// Queued messages get heartbeats like those being worked on.
	stopBeat := every(ctx, c.cfg.AckWait/3, func() bool {
		q.each(func(m jetstream.Msg) { _ = m.InProgress() })
		return true
	})

	// Work in flight finishes on work, which survives ctx: a half-done batch
	// would only be redelivered (an effect cut off half-way performed again after
	// its lease expired), but finishing it is the graceful thing to do.
	// loop ends with ctx, or when the watch finds this database forked.
	loop, stopLoop := context.WithCancel(ctx)
	defer stopLoop()
	var wg sync.WaitGroup
	for range c.cfg.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				batch, ok := q.take(loop, c.cfg.BatchSize, c.cfg.MaxBatchBytes, c.cfg.linger)
				if len(batch) > 0 {
					c.process(work, batch)
				}
				if !ok || loop.Err() != nil {
					return
				}
			}
		}()
	}
	forked := f.watch(ctx) // until ctx ends: keeps the durable consumer alive
	stopLoop()
	f.stop()
	wg.Wait()
	stopBeat()
	// Messages queued but never started go back to the broker now rather than
	// after AckWait.
	for _, m := range q.drain() {
		_ = m.Nak()
	}
	if forked != nil {
		c.log.ErrorContext(ctx, "consumer stopped: its database is forked", "err", forked)
		return forked
	}
	c.log.InfoContext(ctx, "consumer stopped")
	return nil
}

// Register registers the consumer in the installation, as Run does before its
// first message, without consuming: from then on the reconciler expects it to
// settle what it reads. A consumer that looks like a rename is refused here
// (ErrLikelyRenamed), and its Run refuses too. Consumers started together
// register first, then run, so that none takes a sibling that has already
// settled messages for the name it was renamed from: worker.Worker.Start does
// that for its consumers. It retries while the database is unreachable, until
// ctx ends; Run then starts from this registration.
func (c *Consumer) Register(ctx context.Context) error {
	c.readFaults(ctx)
	b, err := c.register(ctx)
	if err != nil {
		return err
	}
	c.regMu.Lock()
	c.registered = &b
	c.regMu.Unlock()
	return nil
}

// registration is the registration Register made, or a new one.
func (c *Consumer) registration(ctx context.Context) (binding, error) {
	c.regMu.Lock()
	b := c.registered
	c.registered = nil // a second Run registers again
	c.regMu.Unlock()
	if b != nil {
		return *b, nil
	}
	return c.register(ctx)
}

// readFaults reads the negative controls armed in ctx.
func (c *Consumer) readFaults(ctx context.Context) {
	fs := faults.From(ctx)
	c.keyOnly, c.anyInstallation, c.ignoreEpoch = fs.On(faults.KeyOnlyIdentity), fs.On(faults.AnyInstallation), fs.On(faults.IgnoreEpoch)
	c.renameBackfills = fs.On(faults.RenameBackfills)
	c.recordOnWork = fs.On(faults.RecordOnWorkContext)
}

// ErrForeignDurable is wrapped by the error of a consumer whose durable JetStream
// consumer belongs to another installation.
var ErrForeignDurable = errors.New("consumer: the durable consumer belongs to another installation")

// ErrForkedDatabase is wrapped by the error of a consumer whose durable JetStream
// consumer records a later binding than its database does: another database with
// the installation's token (a physical copy of this one, or its original) bound it
// since.
var ErrForkedDatabase = errors.New("consumer: another copy of this database bound the durable consumer since")

// binding is what the consumer binds its durable consumer with: the installation
// it belongs to, and where a durable created now starts.
type binding struct {
	installation string
	reg          registry.Registration
	// lastSeq is the stream's last sequence, read before a new consumer
	// registered: a StartNew consumer's first durable starts after it, so that
	// every intent written since the registration is delivered to it.
	lastSeq uint64
}

// startSkew is how far before its registration a StartNew consumer's recreated
// durable starts: the stream's clock and the database's may disagree by that
// much, and an extra older message costs only an effect the consumer was not
// responsible for (or a duplicate its inbox folds).
const startSkew = time.Minute

// durableConfig is the configuration to create or update the durable with: the
// consumer's own, the binding's installation and epoch in the metadata, and, for a
// durable created now, where it starts; an existing durable keeps where it started
// (JetStream refuses to change that).
func (c *Consumer) durableConfig(b binding, st installation.State, existing *jetstream.ConsumerInfo) jetstream.ConsumerConfig {
	cfg := c.JetStreamConfig()
	cfg.Metadata = installation.Metadata(st, b.installation)
	switch {
	case existing != nil:
		cfg.DeliverPolicy, cfg.OptStartSeq, cfg.OptStartTime = existing.Config.DeliverPolicy, existing.Config.OptStartSeq, existing.Config.OptStartTime
		for k, v := range existing.Config.Metadata {
			if _, ours := cfg.Metadata[k]; !ours {
				cfg.Metadata[k] = v
			}
		}
	case b.reg.StartsAt == nil:
		cfg.DeliverPolicy = jetstream.DeliverAllPolicy
	case b.reg.New:
		cfg.DeliverPolicy, cfg.OptStartSeq = jetstream.DeliverByStartSequencePolicy, b.lastSeq+1
	default:
		at := b.reg.StartsAt.Add(-startSkew)
		cfg.DeliverPolicy, cfg.OptStartTime = jetstream.DeliverByStartTimePolicy, &at
	}
	return cfg
}

// bind finds or creates the durable consumer and makes it this installation's,
// recording a new epoch of the installation in it (see claim).
func (c *Consumer) bind(ctx context.Context, b binding) (jetstream.Consumer, error) {
	for range 3 {
		jc, err := c.js.Consumer(ctx, c.stream, c.cfg.Name)
		switch {
		case errors.Is(err, jetstream.ErrConsumerNotFound):
			st, err := c.bump(ctx, installation.Recorded{})
			if err != nil {
				return nil, err
			}
			jc, err = c.js.CreateConsumer(ctx, c.stream, c.durableConfig(b, st, nil))
			if errors.Is(err, jetstream.ErrConsumerExists) {
				continue // created by another worker meanwhile: bind to it
			}
			if err == nil {
				c.checkRecorded(ctx, jc, st)
			}
			return jc, err
		case err != nil:
			return nil, err
		}
		info := jc.CachedInfo()
		st, err := c.claim(ctx, b, installation.FromMetadata(info.Config.Metadata))
		if err != nil {
			return nil, err
		}
		jc, err = c.js.UpdateConsumer(ctx, c.stream, c.durableConfig(b, st, info))
		if err == nil {
			c.checkRecorded(ctx, jc, st)
		}
		return jc, err
	}
	return nil, fmt.Errorf("consumer %s: the durable consumer kept changing while it was being bound", c.cfg.Name)
}

// claim decides whether the durable that recorded rec may be bound, and starts
// the binding (a new epoch) when it may. Tokens name installations: one of
// another token is refused (ErrForeignDurable). One of this token whose epoch is
// ahead of this database's was bound since this database was copied from its
// installation: this database is the copy left behind, and is refused
// (ErrForkedDatabase). The check and the new epoch are one statement, so
// binders of one database never refuse each other. A durable bound before tokens
// is adopted when it names this database the old way, or nothing.
func (c *Consumer) claim(ctx context.Context, b binding, rec installation.Recorded) (installation.State, error) {
	own, err := installation.Load(ctx, c.pool, c.inst.Schema())
	if err != nil {
		return own, fmt.Errorf("consumer %s: %w", c.cfg.Name, err)
	}
	since := rec // the binding this one must not be behind
	switch {
	case c.anyInstallation:
		since = installation.Recorded{}
	case rec.Token == own.Token:
	case rec.Token != "":
		return own, c.foreign(b, own, rec)
	case rec.ID == b.installation:
		c.log.InfoContext(ctx, "consumer: adopting a durable consumer bound before installation tokens; recording this installation's token in it",
			"stream", c.stream, "installation", b.installation, "token", own.Token)
	case rec.ID == "":
		c.log.ErrorContext(ctx, "consumer: adopting a durable consumer whose metadata names no installation (its metadata was removed, or it was created by hand): "+
			"if another installation's workers use it, they now split its messages with this one; stop them, or give one of the two consumers another Name",
			"stream", c.stream, "installation", b.installation, "token", own.Token)
	default:
		return own, c.foreign(b, own, rec)
	}
	if c.ignoreEpoch || rec.Token != own.Token {
		since = installation.Recorded{} // ignored, or bound before tokens
	}
	return c.bump(ctx, since)
}

// bump starts a binding: a new epoch, unless another database bound the durable
// that recorded since after this one did (installation.Ahead).
func (c *Consumer) bump(ctx context.Context, since installation.Recorded) (installation.State, error) {
	st, ok, err := installation.Bump(ctx, c.pool, c.inst.Schema(), since)
	if err != nil {
		return st, fmt.Errorf("consumer %s: %w", c.cfg.Name, err)
	}
	if !ok {
		if st, err = installation.Load(ctx, c.pool, c.inst.Schema()); err != nil {
			return st, fmt.Errorf("consumer %s: %w", c.cfg.Name, err)
		}
		return st, c.forked(st, since)
	}
	return st, nil
}

// foreign is the refusal of a durable of another installation.
func (c *Consumer) foreign(b binding, own installation.State, rec installation.Recorded) error {
	theirs := rec.Token
	if theirs == "" {
		theirs = "(none: bound before installation tokens)"
	}
	move := fmt.Sprintf("if this database replaces that installation on purpose (a move, a blue/green cut-over), stop the old installation's workers "+
		"and run `worker installation adopt %s --epoch %d` here", rec.Token, rec.Epoch)
	if rec.Token == "" {
		move = fmt.Sprintf("if this database is that installation moved (a rename, pg_upgrade, a dump and restore while upgrading to installation tokens), "+
			"stop the old workers and delete the durable (nats consumer rm %s %s): this consumer creates it again and its inbox folds what it re-reads", c.stream, c.cfg.Name)
	}
	return fmt.Errorf("%w: durable consumer %s on stream %s belongs to installation %s (%s), and this consumer to %s (%s); an installation is named by its token, and by cluster/database/schema in parentheses. "+
		"Two installations on one durable split its messages between their inboxes, and each one's reconciler takes the other's acks for losses. "+
		"Give this consumer another Name; or, %s",
		ErrForeignDurable, c.cfg.Name, c.stream, theirs, rec.ID, own.Token, b.installation, move)
}

// forked is the refusal of a database another database with its token bound the
// durable after (installation.Ahead): an epoch ahead of this database's, or the
// same epoch reached by another binding.
func (c *Consumer) forked(own installation.State, durable installation.Recorded) error {
	return fmt.Errorf("%w: durable consumer %s on stream %s was bound at epoch %d of installation %s (binding %s), and this database is at epoch %d (binding %s). "+
		"Another database with this installation's token has bound it since: a physical copy of this one, or the one this database was copied from "+
		"(a restored backup or snapshot, PITR, a clone, a promoted replica). Two databases on one durable split its messages and run their effects in both. "+
		"If this database is a copy (staging, a restore test), point its workers at another NATS account or stream; "+
		"if it is the one to keep, stop every worker of the other and run `worker installation adopt %s --epoch %d` here, then start again",
		ErrForkedDatabase, c.cfg.Name, c.stream, durable.Epoch, own.Token, orNone(durable.Binding), own.Epoch, orNone(own.Binding), own.Token, durable.Epoch)
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

// checkRecorded warns when the broker did not keep the installation in the
// durable's metadata (nats-server before 2.10 drops it): installations sharing
// a durable cannot be told apart there.
func (c *Consumer) checkRecorded(ctx context.Context, jc jetstream.Consumer, st installation.State) {
	if jc.CachedInfo().Config.Metadata[installation.TokenKey] != st.Token {
		c.log.WarnContext(ctx, "consumer: the NATS server does not keep consumer metadata (nats-server 2.10 or later does): "+
			"another installation using this durable name, or a copy of this database, could not be refused", "stream", c.stream)
	}
}

// createDurable binds the durable consumer (see bind). While the stream does not
// exist (it was deleted, and the worker's stream keeper has not recreated it yet)
// it waits, with Health saying so; any other refusal (a filter outside the
// stream's subjects, a durable of another installation) is an error. It returns
// nil, nil when ctx ends first.
func (c *Consumer) createDurable(ctx context.Context, b binding) (jetstream.Consumer, error) {
	failures := 0
	for {
		jc, err := c.bind(ctx, b)
		if err == nil {
			c.setHealth(nil)
			return jc, nil
		}
		switch {
		case errors.Is(err, jetstream.ErrStreamNotFound):
			c.setHealth(fmt.Errorf("consumer %s: stream %s does not exist", c.cfg.Name, c.stream))
			c.log.WarnContext(ctx, "consumer: its stream does not exist; waiting for it", "stream", c.stream)
		case errors.Is(err, ErrForeignDurable), errors.Is(err, ErrForkedDatabase):
			return nil, fmt.Errorf("consumer %s: %w", c.cfg.Name, err)
		case refused(err), failures+1 >= maxCreateFailures:
			return nil, fmt.Errorf("consumer %s: create durable consumer on stream %s: %w", c.cfg.Name, c.stream, err)
		default:
			// JetStream answers a configuration it will not take over ("ack policy
			// can not be updated") and a passing state ("consumer closed", while its
			// stream is being deleted) alike, with a 500; a server may also not
			// answer. Try again a few times, not-ready meanwhile: what persists is
			// the configuration, and fails the consumer.
			failures++
			c.setHealth(fmt.Errorf("consumer %s: cannot create its durable consumer on stream %s yet: %w", c.cfg.Name, c.stream, err))
			c.log.WarnContext(ctx, "consumer: creating the durable consumer failed; retrying", "stream", c.stream, "err", err)
		}
		select {
		case <-ctx.Done():
			return nil, nil
		case <-time.After(c.cfg.CheckInterval):
		}
	}
}

// maxCreateFailures is how many failed attempts to create the durable consumer
// (other than the stream missing, which is waited for) fail the consumer.
const maxCreateFailures = 3

// refused reports a request JetStream answered with a 4xx other than a missing
// stream: the configuration is wrong (a filter outside the stream, a durable of the
// same name with another configuration), and retrying cannot help.
func refused(err error) bool {
	var api jetstream.JetStreamError
	if !errors.As(err, &api) || api.APIError() == nil {
		return false
	}
	code := api.APIError().Code
	return code >= 400 && code < 500 && !errors.Is(err, jetstream.ErrStreamNotFound)
}

// Health says why the consumer cannot receive messages right now (its durable
// consumer or its stream is missing, and recreating it failed), or nil. The worker's
// readiness reports it.
func (c *Consumer) Health() error {
	if p := c.health.Load(); p != nil {
		return *p
	}
	return nil
}

func (c *Consumer) setHealth(err error) {
	if err == nil {
		c.health.Store(nil)
		return
	}
	c.health.Store(&err)
}

// register records the consumer in idem_consumers: which stream and subjects it
// reads, how long it remembers keys, and where it starts. The reconciler proves an
// intent complete only when every registered consumer whose filter matches has
// settled it, so a consumer must be registered before it takes a message; while
// the database is down it waits. It fails when ctx ends first, and refuses a
// likely rename (ErrLikelyRenamed) before registering it.
func (c *Consumer) register(ctx context.Context) (binding, error) {
	wait := 100 * time.Millisecond
	for {
		b, err := c.registerOnce(ctx)
		if err == nil || errors.Is(err, ErrLikelyRenamed) {
			return b, err
		}
		if ctx.Err() != nil {
			return binding{}, ctx.Err()
		}
		c.log.WarnContext(ctx, "consumer: cannot register yet; retrying", "err", err, "retry_in", wait)
		select {
		case <-ctx.Done():
			return binding{}, ctx.Err()
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
}

func (c *Consumer) registerOnce(ctx context.Context) (binding, error) {
	var b binding
	var err error
	if b.installation, err = c.inst.Identify(ctx); err != nil {
		return b, err
	}
	if err = c.refuseRename(ctx); err != nil {
		return b, err
	}
	if c.cfg.Start == StartNew {
		// Read before registering: an intent written after the registration is
		// published after this sequence.
		if b.lastSeq, err = c.lastSeq(ctx); err != nil {
			return b, err
		}
	}
	b.reg, err = registry.Register(ctx, c.pool, c.inst.Schema(), registry.Consumer{
		Name: c.cfg.Name, Stream: c.stream, FilterSubject: c.cfg.Subject,
		KeyLifetime: c.cfg.KeyLifetime, Redelivery: c.cfg.RedeliveryHorizon()}, c.cfg.Start == StartNew)
	return b, err
}

// lastSeq is the stream's last sequence (0 when it does not exist yet).
func (c *Consumer) lastSeq(ctx context.Context) (uint64, error) {
	st, err := c.js.Stream(ctx, c.stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("consumer %s: stream %s: %w", c.cfg.Name, c.stream, err)
	}
	return st.CachedInfo().State.LastSeq, nil
}

// fetcher is the consumer's pull subscription, and what keeps it alive: a durable
// consumer deleted by an operator (or lost with its stream) makes nats.go stop the
// subscription, and a consumer that did not notice would sit idle forever while
// looking healthy.
type fetcher struct {
	c        *Consumer
	q        *queue
	maxBytes int
	binding  binding

	mu sync.Mutex
	jc jetstream.Consumer
	cc jetstream.ConsumeContext
	// subscribed is false once the subscription stopped (nats.go saw the durable
	// consumer deleted, or a recreation failed): watch must start it again even
	// if the durable consumer is back by then, recreated by another worker.
	subscribed bool
	deleted    chan struct{} // signalled when nats.go reports the consumer deleted
}

func (f *fetcher) start(ctx context.Context, jc jetstream.Consumer) error {
	deleted := make(chan struct{}, 1)
	cc, err := jc.Consume(func(m jetstream.Msg) {
		if !f.q.push(ctx, m) {
			_ = m.Nak() // shutting down: hand it straight back for another worker
		}
	}, jetstream.PullMaxBytes(f.maxBytes),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound) {
				// nats.go stops the subscription on a deleted consumer.
				f.mu.Lock()
				f.subscribed = false
				f.mu.Unlock()
				select {
				case deleted <- struct{}{}:
				default:
				}
			}
			f.c.log.WarnContext(ctx, "consumer: pull error", "err", err)
		}))
	if err != nil {
		return fmt.Errorf("consumer %s: consume: %w", f.c.cfg.Name, err)
	}
	f.mu.Lock()
	f.jc, f.cc, f.deleted, f.subscribed = jc, cc, deleted, true
	f.mu.Unlock()
	return nil
}

func (f *fetcher) stop() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.cc != nil {
		f.cc.Stop()
	}
	f.subscribed = false
}

// watch checks the durable consumer every CheckInterval (at once when nats.go
// reports it deleted) until ctx ends, and recreates it — and the subscription —
// when either is gone. While it cannot (its stream is gone too), Health says so;
// the worker recreates streams. It also refreshes the registration. It returns
// early, with ErrForkedDatabase, when a copy of this database has bound the
// durable since this consumer did: the two would split its messages.
func (f *fetcher) watch(ctx context.Context) error {
	c := f.c
	// At least every SeenEvery, so the registration is refreshed on time.
	t := time.NewTicker(min(c.cfg.CheckInterval, registry.SeenEvery))
	defer t.Stop()
	lastSeen := time.Now()
	for {
		f.mu.Lock()
		jc, deleted := f.jc, f.deleted
		f.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		case <-deleted:
		}
		info, err := jc.Info(ctx)
		if err == nil {
			if err := c.checkFork(ctx, installation.FromMetadata(info.Config.Metadata)); err != nil {
				return err
			}
		}
		f.mu.Lock()
		subscribed := f.subscribed
		f.mu.Unlock()
		switch {
		case err == nil && subscribed:
			c.setHealth(nil)
		case err == nil, errors.Is(err, jetstream.ErrConsumerNotFound), errors.Is(err, jetstream.ErrStreamNotFound):
			// The durable consumer is missing, or back (another worker recreated
			// it) while this subscription is stopped.
			f.recreate(ctx)
		case ctx.Err() == nil:
			c.log.WarnContext(ctx, "consumer: cannot check the durable consumer", "err", err)
		}
		if time.Since(lastSeen) > registry.SeenEvery {
			if err := registry.Seen(ctx, c.pool, c.inst.Schema(), c.cfg.Name, c.cfg.KeyLifetime); err == nil {
				lastSeen = time.Now()
			}
		}
	}
}

// checkFork returns ErrForkedDatabase when the durable that recorded rec was
// bound since by a copy of this database: the same token, and ahead of this
// database's row (installation.Ahead; the row is read after the durable, so a
// binder of this database is never ahead). Other states are the next binding's to judge.
func (c *Consumer) checkFork(ctx context.Context, rec installation.Recorded) error {
	if c.ignoreEpoch || c.anyInstallation || rec.Token == "" {
		return nil
	}
	own, err := installation.Load(ctx, c.pool, c.inst.Schema())
	if err != nil || rec.Token != own.Token || !installation.Ahead(own, rec) {
		return nil // a database unreachable now: the next check reads it again
	}
	return fmt.Errorf("consumer %s: %w", c.cfg.Name, c.forked(own, rec))
}

// recreate creates (or finds) the durable consumer again and restarts the
// subscription on it. On failure the subscription stays stopped, Health says why,
// and the next check tries again.
func (f *fetcher) recreate(ctx context.Context) {
	c := f.c
	f.stop()
	jc, err := c.bind(ctx, f.binding)
	if err != nil {
		if ctx.Err() == nil {
			c.setHealth(fmt.Errorf("consumer %s: its durable consumer on stream %s is missing and cannot be recreated: %w", c.cfg.Name, c.stream, err))
			c.log.ErrorContext(ctx, "consumer: durable consumer missing; recreating it failed", "stream", c.stream, "err", err)
		}
		return
	}
	if err := f.start(ctx, jc); err != nil {
		c.setHealth(err)
		return
	}
	c.setHealth(nil)
	c.log.WarnContext(ctx, "consumer: subscription was stopped (its durable consumer went missing); resumed it on the durable consumer (a new one delivers again what the stream holds from the consumer's start, which the inbox folds; what the stream lost, the reconciler re-drives)", "stream", c.stream)
}
