package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/natssubject"
	"github.com/idemkit/idem/internal/otelmsg"
	"github.com/idemkit/idem/internal/parts"
	"github.com/idemkit/idem/internal/store"
	"github.com/idemkit/idem/internal/wake"
	"github.com/idemkit/idem/wire"
)

// ErrTooLarge is returned (wrapped) by Enqueue for a message bigger than the
// broker's max_payload. An HTTP ingress answers it with 413.
var ErrTooLarge = errors.New("outbox: message larger than the broker's max_payload")

// Outbox writes messages into an installation's idem_outbox inside the caller's
// transactions. It holds no connection and is safe for concurrent use.
type Outbox struct {
	// subjects are the stream's: Enqueue refuses a message whose subject matches
	// none of them, since no stream would store it and it would be retried forever.
	subjects []string
	// maxPayload is the largest message the broker takes, payload plus headers,
	// as NATS counts it (the server's max_payload): Enqueue refuses a bigger one
	// with ErrTooLarge before anything is written. Zero: no check.
	maxPayload int64
	// stream is the stream the relay expects its publishes to land in: its name
	// travels in a header, which the size check counts.
	stream string
	q      store.Outbox
	pool   *pgxpool.Pool
	wake   *wake.Waker
	tracer trace.Tracer
	// relayed caches which relay new rows belong to, for a process without a
	// relay of its own: a log relay needs no NOTIFY.
	relayed *relayedBy
}

// relayedBy is which relay the outbox's new rows belong to, as last read.
type relayedBy struct {
	mu      sync.Mutex
	byLog   bool
	read    time.Time
	reading bool // a reading is on its way
}

// relayedRecheck is how long a reading of the outbox's relay is trusted: a change
// of relay costs at most this long of NOTIFYs sent or missed (a missed one, the
// polling relay's poll).
const relayedRecheck = 5 * time.Second

// RelayConsumer is the consumer name under which the relay files the dead letters
// of messages the broker refused or that no consumer reads: the name to give
// deadletter.Filter to see or replay them.
const RelayConsumer = store.RelayConsumer

// New returns the outbox of inst: its stream's subjects and its broker's
// max_payload bound what Enqueue accepts, and every Outbox of one Installation
// wakes the same relays.
func New(inst *install.Installation) *Outbox {
	var maxPayload int64
	if js := inst.JetStream(); js != nil {
		maxPayload = js.Conn().MaxPayload()
	}
	return &Outbox{
		subjects: inst.Stream().Subjects, maxPayload: maxPayload, stream: inst.Stream().Name,
		q: parts.Of(inst).Store.Outbox, pool: inst.Pool(), wake: parts.Of(inst).Waker,
		tracer: otelmsg.Tracer(inst.TracerProvider()), relayed: &relayedBy{},
	}
}

// Enqueue writes msgs into the outbox inside the caller's transaction, in one
// statement, so the messages exist if and only if the caller's business rows
// commit. A log relay reads the commit from its slot; a polling relay is woken by
// a NOTIFY that Postgres delivers at commit.
//
// Each message's Key must be a scoped key (idem.ScopedKey; producer.Intent.Enqueue
// stamps it for you), its Subject a literal subject under the stream's subjects, its Name
// valid (idem.ValidateMessageName), and its Payload non-nil. One intent's messages
// on one subject need distinct names, or a consumer folds them into one delivery.
// Headers must be valid NATS headers and must not set the relay's own
// (wire.IsRelayHeader): the relay derives them from the row, and a caller's own Msg-Id
// would let the broker fold a different intent into this one. Nor may they use the
// broker's Nats- prefix (wire.ReservedByBroker), which the stream obeys.
// Each message gets a producer span (the installation's TracerProvider), whose trace context is
// added to its headers through the global propagator.
//
// After an error the transaction is aborted (or the message was refused before any
// statement ran, in which case nothing was written); roll it back.
func (o *Outbox) Enqueue(ctx context.Context, tx pgx.Tx, msgs ...idem.Message) error {
	return o.insert(ctx, tx, msgs, republish{})
}

// Republish enqueues msgs again, inside tx, for the one consumer named replayFor
// (idem.HeaderReplayFor), under a new Msg-Id generation: each Nats-Msg-Id becomes
// the message's own plus the byte 0x1D and generation, so the broker's duplicate
// window does not fold it into the first publish, while the consumer's inbox still
// folds it by key and message. It is how a dead letter is replayed. generation must
// be a non-empty token (no spaces) unique to this republish; an empty replayFor
// sends the copy to every consumer of the subject.
func (o *Outbox) Republish(ctx context.Context, tx pgx.Tx, generation, replayFor string, msgs ...idem.Message) error {
	if err := idem.ValidateSubject(generation); err != nil {
		return fmt.Errorf("outbox: republish: generation %q must be a non-empty token without spaces", generation)
	}
	if strings.Contains(replayFor, ",") {
		return fmt.Errorf("outbox: republish: consumer name %q contains a comma", replayFor)
	}
	return o.insert(ctx, tx, msgs, republish{generation: generation, replayFor: replayFor})
}

// republish is what a deliberate re-publish adds to a message: its Msg-Id
// generation and the consumer it is for.
type republish struct {
	generation, replayFor string
}

// generationSep starts a re-publish's generation in its Msg-Id: not printable, so
// no key, scope or name contains it (see idem.Message.MsgID).
const generationSep = "\x1d"

func (o *Outbox) insert(ctx context.Context, tx pgx.Tx, msgs []idem.Message, again republish) error {
	rows, err := o.prepare(ctx, msgs, again)
	if err != nil || rows == nil {
		return err
	}
	if _, err := tx.Exec(ctx, rows.statement(o.q), rows.args()...); err != nil {
		return fmt.Errorf("outbox: enqueue: %w", err)
	}
	if o.wake.Logged() || o.byLog() {
		return nil // the log relay reads the commit from its slot
	}
	if _, err := tx.Exec(ctx, o.q.Notify, o.q.Channel); err != nil {
		return fmt.Errorf("outbox: enqueue: notify: %w", err)
	}
	return nil
}

// AddToBatch is Enqueue for a caller that pipelines its statements: it checks msgs
// at once (the same refusals as Enqueue, with nothing written) and queues their
// INSERT on b, which the caller sends inside its transaction (tx.SendBatch) with
// its other statements, in one round trip.
//
// It sends no NOTIFY, because a NOTIFY in a transaction serialises its commit with
// every other notifying transaction's: call Wake once the transaction has
// committed. A forgotten Wake costs latency (up to the relay's poll, a second),
// never a message. The producer middleware does all of this for its handlers.
func (o *Outbox) AddToBatch(ctx context.Context, b *pgx.Batch, msgs ...idem.Message) error {
	rows, err := o.prepare(ctx, msgs, republish{})
	if err != nil || rows == nil {
		return err
	}
	b.Queue(rows.statement(o.q), rows.args()...)
	return nil
}

// outboxRows are messages checked and encoded for the enqueue statement, one slice
// per column.
type outboxRows struct {
	keys, subjects, msgIDs, headers, names []string
	payloads                               [][]byte
}

// statement is the enqueue statement for r: one VALUES row for one message, or
// unnest over the columns for more.
func (r *outboxRows) statement(q store.Outbox) string {
	if len(r.keys) == 1 {
		return q.EnqueueOne
	}
	return q.Enqueue
}

func (r *outboxRows) args() []any {
	if len(r.keys) == 1 {
		return []any{r.keys[0], r.subjects[0], r.msgIDs[0], r.headers[0], r.payloads[0], r.names[0]}
	}
	return []any{r.keys, r.subjects, r.msgIDs, r.headers, r.payloads, r.names}
}

// prepare checks msgs and encodes them for the enqueue statement (nil when msgs is
// empty), stamping the caller's trace context into their headers.
func (o *Outbox) prepare(ctx context.Context, msgs []idem.Message, again republish) (*outboxRows, error) {
	if len(msgs) == 0 {
		return nil, nil
	}
	r := &outboxRows{
		keys: make([]string, len(msgs)), subjects: make([]string, len(msgs)), msgIDs: make([]string, len(msgs)),
		headers: make([]string, len(msgs)), payloads: make([][]byte, len(msgs)), names: make([]string, len(msgs)),
	}
	for i, m := range msgs {
		if err := o.check(m); err != nil {
			return nil, fmt.Errorf("outbox: enqueue message %d: %w", i, err)
		}
		r.keys[i], r.subjects[i], r.msgIDs[i], r.names[i] = m.Key, m.Subject, m.MsgID(), m.Name
		if again.generation != "" {
			r.msgIDs[i] += generationSep + again.generation
		}
		h := o.traced(ctx, m, r.msgIDs[i])
		if again.replayFor != "" {
			h[idem.HeaderReplayFor] = again.replayFor
		}
		hj, err := json.Marshal(h)
		if err != nil {
			return nil, fmt.Errorf("outbox: enqueue: encode headers: %w", err)
		}
		if size := wireSize(m, r.msgIDs[i], o.stream, h); o.maxPayload > 0 && size > o.maxPayload {
			return nil, fmt.Errorf("outbox: enqueue message %d: %w: %d bytes with its headers, the broker takes %d", i, ErrTooLarge, size, o.maxPayload)
		}
		r.headers[i], r.payloads[i] = string(hj), m.Payload
	}
	return r, nil
}

// check refuses, before anything is written, a message the broker could never take
// or that would lose its identity on the way.
func (o *Outbox) check(m idem.Message) error {
	if _, _, err := idem.ParseScopedKey(m.Key); err != nil {
		return err
	}
	if err := idem.ValidateSubject(m.Subject); err != nil {
		return err
	}
	if err := idem.ValidateMessageName(m.Name); err != nil {
		return err
	}
	if len(o.subjects) > 0 && !natssubject.Under(o.subjects, m.Subject) {
		return fmt.Errorf("%w: %q is outside the stream's subjects %q", idem.ErrBadSubject, m.Subject, o.subjects)
	}
	if m.Payload == nil {
		return errors.New("nil payload")
	}
	for name, v := range m.Headers {
		if wire.IsRelayHeader(name) {
			return fmt.Errorf("header %s is set by the relay; do not set it", name)
		}
		if wire.ReservedByBroker(name) {
			return fmt.Errorf("header %s is in the broker's reserved Nats- namespace; do not set it", name)
		}
		if err := wire.ValidateHeader(name, v); err != nil {
			return err
		}
	}
	return nil
}

// wireSize is m's size as NATS counts it against max_payload: the payload plus the
// header block the relay will send ("NATS/1.0\r\n", "Name: value\r\n" for every
// header including the relay's own and, when the relay expects a stream,
// Nats-Expected-Stream, and a final "\r\n").
func wireSize(m idem.Message, msgID, stream string, headers map[string]string) int64 {
	n := len("NATS/1.0\r\n") + len("\r\n")
	line := func(k, v string) { n += len(k) + len(": ") + len(v) + len("\r\n") }
	for k, v := range headers {
		line(k, v)
	}
	line(idem.HeaderKey, m.Key)
	line(idem.HeaderMsgID, msgID)
	line(idem.HeaderEnqueuedAt, enqueuedAtSample)
	if m.Name != "" {
		line(idem.HeaderMessage, m.Name)
	}
	if stream != "" {
		line(jetstream.ExpectedStreamHeader, stream)
	}
	return int64(n + len(m.Payload))
}

// enqueuedAtSample is a value in store.EnqueuedAtLayout, as long as every one of
// them.
const enqueuedAtSample = "2006-01-02T15:04:05.000000Z"

// traced starts the message's producer span ("enqueue <subject>", a child of the
// caller's span), and returns the headers with its trace context added through the
// global propagator, so the consumer's span continues it. A traceparent the caller
// set is kept as it is. The caller's map is not modified.
func (o *Outbox) traced(ctx context.Context, m idem.Message, msgID string) map[string]string {
	h := make(map[string]string, len(m.Headers)+2)
	maps.Copy(h, m.Headers)
	ctx, span := o.tracer.Start(ctx, otelmsg.SpanName(otelmsg.OpEnqueue, m.Subject),
		trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(otelmsg.Create(m.Subject, msgID)...))
	defer span.End()
	if _, set := h["traceparent"]; !set {
		otelmsg.Inject(ctx, h)
	}
	return h
}

// byLog reports whether the outbox's new rows belong to a log relay, which reads
// commits from its slot and needs no wake-up. It answers from the last reading of
// the outbox's relay column and, when that reading is older than relayedRecheck,
// starts the next one in the background: the check never adds a round trip to
// the caller's request. Until a first reading lands, and after a failed one, it
// says no, which costs a NOTIFY nobody needs, never a missed one.
func (o *Outbox) byLog() bool {
	r := o.relayed
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.reading && time.Since(r.read) >= relayedRecheck {
		r.reading = true
		go o.readRelay()
	}
	return r.byLog
}

// readRelay reads which relay new rows belong to into o.relayed.
func (o *Outbox) readRelay() {
	ctx, cancel := context.WithTimeout(context.Background(), relayedRecheck)
	defer cancel()
	var def string
	err := o.pool.QueryRow(ctx, o.q.RelayDefault).Scan(&def)
	r := o.relayed
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reading, r.read = false, time.Now()
	r.byLog = err == nil && strings.HasPrefix(def, "'log'")
}

// Wake tells the relays that rows written with AddToBatch have committed. Call it
// after the commit, never before: a relay woken early finds nothing and sleeps
// until its next poll.
//
// A relay of this process, on the same Installation, is woken directly, at no cost
// to the database. Otherwise Wake sends a NOTIFY, outside any transaction of the
// caller's, coalescing concurrent calls: a caller that arrives while a NOTIFY is on
// its way shares the next one with everyone who arrived meanwhile, so a burst of
// commits costs a few NOTIFYs, and no caller waits for more than two. Each NOTIFY
// starts after every commit it announces, which is what makes it safe to share.
//
// An error means the NOTIFY failed; the rows are committed all the same and a
// relay's poll will find them.
func (o *Outbox) Wake(ctx context.Context) error {
	if o.wake.Local() || o.byLog() {
		return nil
	}
	if err := o.wake.Notify(ctx, func(ctx context.Context) error {
		_, err := o.pool.Exec(ctx, o.q.Notify, o.q.Channel)
		return err
	}); err != nil {
		return fmt.Errorf("outbox: wake: %w", err)
	}
	return nil
}
