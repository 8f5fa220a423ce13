package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The external tests reuse setup and bundle from consumer_test.go.
const extName = "external"

// extConfig is an External with test-friendly timings: short leases and ack waits,
// quick retries.
func (b *bundle) extConfig(h consumer.ExternalHandler) consumer.Config {
	return consumer.Config{
		Name:     extName,
		Subject:  testenv.Subject,
		External: h,
		LeaseFor: 500 * time.Millisecond,
		AckWait:  500 * time.Millisecond,
		Backoff:  func(int) time.Duration { return 50 * time.Millisecond },
	}
}

// traced makes the bundle's installation trace with tp.
func (b *bundle) traced(t *testing.T, tp trace.TracerProvider) {
	t.Helper()
	b.inst = b.env.Install(t, func(c *install.Config) { c.Observer, c.TracerProvider = b.out.Observe, tp })
}

// dieAfterPerform is a context whose consumer "dies" after an effect succeeded and
// before its outcome is recorded, whenever dies says so for the effect's key.
func dieAfterPerform(dies func(key string) bool) context.Context {
	return faults.With(context.Background(), faults.New().Func(faults.ExternalAfterPerform, func(_ context.Context, keys []string) error {
		if dies(keys[0]) {
			return errors.New("fault: worker died after the effect, before completing")
		}
		return nil
	}))
}

// effectLog records every call of a fake external effect.
type effectLog struct {
	mu    sync.Mutex
	calls []effectCall
}

type effectCall struct {
	key, downstreamKey string
	attempt            int
	step               string
}

func (l *effectLog) record(e *consumer.Effect) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls = append(l.calls, effectCall{key: e.Key, downstreamKey: e.KeyFor("send"), attempt: e.Attempt, step: e.Step})
}

func (l *effectLog) count(key string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, c := range l.calls {
		if c.key == key {
			n++
		}
	}
	return n
}

func (l *effectLog) of(key string) []effectCall {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []effectCall
	for _, c := range l.calls {
		if c.key == key {
			out = append(out, c)
		}
	}
	return out
}

func inboxRow(t *testing.T, b *bundle, key string) (status string, result []byte, attempts int) {
	t.Helper()
	err := b.env.DB.Pool.QueryRow(context.Background(),
		`SELECT status, result, lease_attempts FROM idem_inbox WHERE consumer = $1 AND key = $2`, extName, key).
		Scan(&status, &result, &attempts)
	if err != nil {
		t.Fatalf("inbox row %q: %v", key, err)
	}
	return status, result, attempts
}

// The effect runs once per key; its result is stored; copies of the message with
// other Nats-Msg-Ids, before and after completion, are acked without an effect.
func TestExternalCompletesOnceAndFoldsDuplicates(t *testing.T) {
	b := setup(t)
	var log effectLog
	h := consumer.ExternalHandlerFunc(func(_ context.Context, e *consumer.Effect) ([]byte, error) {
		log.record(e)
		return fmt.Appendf(nil, `{"sent_to":%q}`, string(e.Payload)), nil
	})
	for i := range 3 {
		b.env.Publish(t, testenv.Subject, "k-once", fmt.Sprintf("copy-%d", i), []byte("a@example.com"))
	}
	b.env.Publish(t, testenv.Subject, "k-other", "other", []byte("b@example.com"))
	b.start(t, b.extConfig(h))

	drained := b.env.Drained(t, extName)
	testenv.Eventually(t, 45*time.Second, "both keys completed and all 4 messages acked", func() bool {
		return b.out.Get(idem.OutcomeProcessed) == 2 && drained()
	})
	if n := log.count("k-once"); n != 1 {
		t.Fatalf("effects for k-once = %d, want 1", n)
	}
	if n := log.count("k-other"); n != 1 {
		t.Fatalf("effects for k-other = %d, want 1", n)
	}
	status, result, attempts := inboxRow(t, b, "k-once")
	if status != "done" || string(result) != `{"sent_to":"a@example.com"}` || attempts != 1 {
		t.Fatalf("inbox row = %s %q attempts %d, want done with the first result after 1 attempt", status, result, attempts)
	}

	// A late copy (a relay re-publish, a dead-letter replay) is a duplicate too.
	dups := b.out.Get(idem.OutcomeDuplicate)
	b.env.Publish(t, testenv.Subject, "k-once", "late-copy", []byte("a@example.com"))
	testenv.Eventually(t, 45*time.Second, "the late copy folded", func() bool {
		return b.out.Get(idem.OutcomeDuplicate) > dups && drained()
	})
	if n := log.count("k-once"); n != 1 {
		t.Fatalf("effects for k-once after a late copy = %d, want 1", n)
	}
}

// A long effect keeps its lease and its message: the lease is extended and
// JetStream gets in-progress heartbeats well past LeaseFor and AckWait, and a copy
// of the message that arrives meanwhile backs off instead of running a second
// effect. When the first finishes, the copy is folded.
//
// On a machine too loaded to extend a lease in time, the holder's fence cancels
// its attempt and the next one takes the key over with the same downstream key:
// that is the design, not a double effect. What must never happen is two attempts
// at once, and that is what the test asserts, whatever the machine's load.
func TestExternalLiveLeaseMakesCopyBackOff(t *testing.T) {
	b := setup(t)
	var log effectLog
	var running, overlaps atomic.Int32
	var began atomic.Pointer[time.Time] // when the attempt now running began; nil between attempts
	release := make(chan struct{})
	var releaseOnce sync.Once
	h := consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
		log.record(e)
		if running.Add(1) > 1 {
			overlaps.Add(1)
		}
		now := time.Now()
		began.Store(&now)
		defer func() {
			began.Store(nil)
			running.Add(-1)
		}()
		select { // the effect is "still sending"
		case <-release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return []byte(`"sent"`), nil
	})
	cfg := b.extConfig(h)
	// An extension every 400ms, each given 400ms; the fence stops an attempt whose
	// lease went 960ms without one.
	cfg.LeaseFor, cfg.AckWait = 1200*time.Millisecond, 1200*time.Millisecond
	cfg.Concurrency = 2 // a free slot for the copy, so only the lease can hold it back
	b.start(t, cfg)
	// Registered after the consumer's stop, so it runs first: a failed assertion
	// must not leave the handler holding up the stop.
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) })

	b.env.Publish(t, testenv.Subject, "k-slow", "first", []byte("x"))
	// One attempt running for two LeaseFors: its fence would have cancelled it
	// long before, had its lease not been extended.
	testenv.Eventually(t, 45*time.Second, "an attempt holding its lease for two LeaseFors", func() bool {
		p := began.Load()
		return p != nil && time.Since(*p) > 2*cfg.LeaseFor
	})
	busy := b.out.Get(idem.OutcomeBusy)
	if attempts := log.count("k-slow"); attempts == 1 && busy != 0 {
		// With one attempt so far, nothing but a missed heartbeat brings the
		// holder's own message back while it runs.
		t.Fatalf("the holder's own message came back %d times while it was being performed: heartbeats missing", busy)
	}

	b.env.Publish(t, testenv.Subject, "k-slow", "copy", []byte("x"))
	testenv.Eventually(t, 45*time.Second, "the copy to back off twice (or run beside the holder)", func() bool {
		return b.out.Get(idem.OutcomeBusy) >= busy+2 || overlaps.Load() > 0
	})
	if n := overlaps.Load(); n != 0 {
		t.Fatalf("%d attempts started while another was still performing the effect", n)
	}

	releaseOnce.Do(func() { close(release) })
	testenv.Eventually(t, 45*time.Second, "first processed and copy folded", func() bool {
		return b.out.Get(idem.OutcomeProcessed) == 1 && b.out.Get(idem.OutcomeDuplicate) >= 1
	})
	if n := overlaps.Load(); n != 0 {
		t.Fatalf("%d attempts started while another was still performing the effect", n)
	}
	calls := log.of("k-slow")
	for _, c := range calls {
		if c.downstreamKey != calls[0].downstreamKey {
			t.Fatalf("attempts %+v: want every one presenting the same downstream key", calls)
		}
	}
	if len(calls) > 1 {
		t.Logf("%d attempts, one after another: a lease extension was late on this machine and the next attempt took over", len(calls))
	}
}

// The worker dies after the effect reached the downstream and before CompleteLease:
// its lease expires, the message comes back to another worker, which takes the
// lease over and performs the effect again with the same downstream key. A
// downstream that honours the key folds it; one that does not sees it twice, never
// zero times.
func TestExternalExpiredLeaseReRunsWithSameKey(t *testing.T) {
	b := setup(t)
	var log effectLog
	h := consumer.ExternalHandlerFunc(func(_ context.Context, e *consumer.Effect) ([]byte, error) {
		log.record(e)
		return fmt.Appendf(nil, `{"attempt":%d}`, e.Attempt), nil
	})
	var died atomic.Bool
	cfg := b.extConfig(h)
	cfg.LeaseFor, cfg.AckWait = 800*time.Millisecond, 300*time.Millisecond
	stop := b.startCtx(t, dieAfterPerform(func(string) bool {
		died.Store(true)
		return true
	}), cfg)
	b.env.Publish(t, testenv.Subject, "k-died", "k-died", []byte("x"))
	testenv.Eventually(t, 45*time.Second, "the first worker to perform and die", died.Load)
	stop()
	if status, _, _ := inboxRow(t, b, "k-died"); status != "leased" {
		t.Fatalf("after the crash the key is %q, want leased (performed, not completed)", status)
	}

	b.start(t, cfg) // the next worker, same durable consumer
	testenv.Eventually(t, 45*time.Second, "the takeover to complete", func() bool {
		return b.out.Get(idem.OutcomeProcessed) == 1
	})
	calls := log.of("k-died")
	if len(calls) != 2 {
		t.Fatalf("effects = %d, want 2 (the dead worker's and the takeover)", len(calls))
	}
	if calls[0].downstreamKey != calls[1].downstreamKey || calls[0].attempt != 1 || calls[1].attempt != 2 {
		t.Fatalf("attempts %+v: want attempts 1 and 2 presenting the same downstream key", calls)
	}
	status, result, attempts := inboxRow(t, b, "k-died")
	if status != "done" || string(result) != `{"attempt":2}` || attempts != 2 {
		t.Fatalf("inbox row = %s %q attempts %d, want done with the takeover's result", status, result, attempts)
	}
	t.Logf("busy back-offs while the dead worker's lease ran out: %d", b.out.Get(idem.OutcomeBusy))

	// Completed: a later copy is folded without a third effect.
	b.env.Publish(t, testenv.Subject, "k-died", "later", []byte("x"))
	testenv.Eventually(t, 45*time.Second, "the later copy folded", func() bool {
		return b.out.Get(idem.OutcomeDuplicate) == 1
	})
	if n := log.count("k-died"); n != 2 {
		t.Fatalf("effects after completion = %d, want still 2", n)
	}
}

// A failed attempt releases its lease (the retry does not wait for LeaseFor, which
// here is a minute) and the retry resumes after the last checkpoint instead of
// repeating the steps before it.
func TestExternalFailureResumesFromCheckpoint(t *testing.T) {
	b := setup(t)
	var stepOne, stepTwo atomic.Int32
	var log effectLog
	h := consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
		log.record(e)
		if e.Step == "" {
			stepOne.Add(1)
			if err := e.Checkpoint(ctx, "one", []byte(`{"id":"s1"}`)); err != nil {
				return nil, err
			}
		}
		if e.Attempt == 1 {
			return nil, errors.New("downstream timed out in step two")
		}
		if e.Step != "one" || string(e.StepState) != `{"id":"s1"}` {
			return nil, consumer.Permanent(fmt.Errorf("resumed at %q with %q", e.Step, e.StepState))
		}
		stepTwo.Add(1)
		return []byte(`"both steps"`), nil
	})
	cfg := b.extConfig(h)
	cfg.LeaseFor = time.Minute
	b.start(t, cfg)
	b.env.Publish(t, testenv.Subject, "k-steps", "k-steps", []byte("x"))
	testenv.Eventually(t, 45*time.Second, "the retry to complete", func() bool {
		return b.out.Get(idem.OutcomeProcessed) == 1
	})
	if stepOne.Load() != 1 || stepTwo.Load() != 1 {
		t.Fatalf("step one ran %d times, step two %d; want 1 and 1", stepOne.Load(), stepTwo.Load())
	}
	if calls := log.of("k-steps"); len(calls) != 2 || calls[1].step != "one" {
		t.Fatalf("attempts %+v: want 2, the second resuming after step one", calls)
	}
	if b.out.Get(idem.OutcomeFailed) != 1 {
		t.Errorf("failed outcomes = %d, want 1", b.out.Get(idem.OutcomeFailed))
	}
}

// Every kind of poison is dead-lettered with its reason while good messages keep
// flowing: no key, a malformed key, a key reused with another payload, a Permanent
// error, a handler that keeps failing, and a message whose workers keep dying.
func TestExternalPoisonIsDeadLettered(t *testing.T) {
	b := setup(t)
	var log effectLog
	h := consumer.ExternalHandlerFunc(func(_ context.Context, e *consumer.Effect) ([]byte, error) {
		log.record(e)
		var p struct{ Do string }
		if err := json.Unmarshal(e.Payload, &p); err != nil {
			return nil, consumer.Permanent(err)
		}
		switch p.Do {
		case "perm":
			return nil, consumer.Permanent(errors.New("recipient rejected"))
		case "flaky":
			return nil, errors.New("downstream unavailable")
		}
		return []byte(`"ok"`), nil
	})
	cfg := b.extConfig(h)
	cfg.MaxDeliver = 3
	cfg.LeaseFor, cfg.AckWait = 300*time.Millisecond, 300*time.Millisecond
	// The worker dies on k-die after every successful attempt, before recording it.
	dying := dieAfterPerform(func(key string) bool { return key == "k-die" })

	good := []byte(`{"do":"ok"}`)
	cases := []struct {
		name, key string
		payload   []byte
		reason    string
	}{
		{"no key", "", good, "missing Idempotency-Key"},
		{"malformed key", strings.Repeat("k", 300), good, "malformed Idempotency-Key"},
		{"fingerprint mismatch", "k-good-0", []byte(`{"do":"ok","to":"someone else"}`), "fingerprint mismatch"},
		{"permanent error", "k-perm", []byte(`{"do":"perm"}`), "permanent handler error: permanent: recipient rejected"},
		{"keeps failing", "k-flaky", []byte(`{"do":"flaky"}`), "max deliveries exceeded: failed 3 attempts"},
		{"worker keeps dying", "k-die", []byte(`{"do":"die"}`), "max deliveries exceeded: attempted 3 times"},
	}
	b.env.Publish(t, testenv.Subject, "k-good-0", "good-0", good)
	for i, tc := range cases {
		b.env.Publish(t, testenv.Subject, tc.key, "poison-"+tc.name, tc.payload)
		b.env.Publish(t, testenv.Subject, fmt.Sprintf("k-good-%d", i+1), "good-"+tc.name, good)
	}
	b.startCtx(t, dying, cfg)

	drained := b.env.Drained(t, extName)
	testenv.Eventually(t, 45*time.Second, "all good processed and every message settled", func() bool {
		return b.out.Get(idem.OutcomeProcessed) == len(cases)+1 && drained()
	})
	for _, tc := range cases {
		n := b.env.DB.Count(t, `SELECT count(*) FROM idem_dead_letters WHERE consumer = $1 AND key = $2 AND reason LIKE $3 || '%'`, extName, tc.key, tc.reason)
		if n != 1 {
			t.Errorf("%s: %d dead letters with reason %q, want 1", tc.name, n, tc.reason)
		}
	}
	if n := log.count("k-flaky"); n != 3 {
		t.Errorf("attempts of the failing message = %d, want MaxDeliver (3)", n)
	}
	if n := log.count("k-die"); n != 3 {
		t.Errorf("attempts of the message whose workers die = %d, want 3 (then the next delivery is dead-lettered unrun)", n)
	}
	// The mismatched copy did not touch the first: one effect, the first result.
	if n := log.count("k-good-0"); n != 1 {
		t.Errorf("effects for k-good-0 = %d, want 1", n)
	}
	// Keys that never completed are left leased, expired, with their recovery
	// point, so a replay of the dead letter can run them.
	if n := b.env.DB.Count(t, `SELECT count(*) FROM idem_inbox WHERE key IN ('k-perm','k-flaky','k-die') AND status = 'leased' AND lease_until <= now()`); n != 3 {
		t.Errorf("released keys of dead letters = %d, want 3", n)
	}
}

// Perform runs inside the delivery's span, a child of the producer's trace, so a
// handler's own calls downstream join the intent's trace.
func TestExternalContinuesProducerTrace(t *testing.T) {
	b := setup(t)
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	rec := tracetest.NewSpanRecorder()
	var seen atomic.Value
	h := consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
		seen.Store(trace.SpanContextFromContext(ctx).TraceID().String())
		return nil, nil
	})
	cfg := b.extConfig(h)
	b.traced(t, sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	msg := nats.NewMsg(testenv.Subject)
	msg.Header.Set(idem.HeaderKey, "k-traced")
	msg.Header.Set("traceparent", "00-"+traceID+"-00f067aa0ba902b7-01")
	msg.Data = []byte("x")
	if _, err := b.env.JS.PublishMsg(context.Background(), msg); err != nil {
		t.Fatal(err)
	}
	b.start(t, cfg)
	testenv.Eventually(t, 45*time.Second, "the traced message processed", func() bool {
		return b.out.Get(idem.OutcomeProcessed) == 1 && len(rec.Ended()) == 1
	})
	if got, _ := seen.Load().(string); got != traceID {
		t.Errorf("Perform's trace id = %q, want the producer's %s", got, traceID)
	}
	sp := rec.Ended()[0]
	if sp.Name() != "process "+testenv.Subject || sp.SpanContext().TraceID().String() != traceID || sp.SpanKind() != trace.SpanKindConsumer {
		t.Errorf("span %q (%v) in trace %s, want the process span in the producer's trace", sp.Name(), sp.SpanKind(), sp.SpanContext().TraceID())
	}
	attrs := map[string]string{}
	for _, a := range sp.Attributes() {
		attrs[string(a.Key)] = a.Value.Emit()
	}
	for k, want := range map[string]string{
		"messaging.system": "nats", "messaging.operation.type": "process", "messaging.operation.name": "process",
		"messaging.destination.name": testenv.Subject, "messaging.consumer.group.name": cfg.Name,
	} {
		if attrs[k] != want {
			t.Errorf("process span %s = %q, want %q", k, attrs[k], want)
		}
	}
}

// A failing effect fails its process span: the error is recorded and the status
// says why, so a trace backend shows where an intent stopped.
func TestFailedEffectFailsItsSpan(t *testing.T) {
	b := setup(t)
	rec := tracetest.NewSpanRecorder()
	h := consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
		return nil, consumer.Permanent(errors.New("the provider refused the card"))
	})
	cfg := b.extConfig(h)
	b.traced(t, sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	msg := nats.NewMsg(testenv.Subject)
	msg.Header.Set(idem.HeaderKey, "k-refused")
	msg.Data = []byte("x")
	if _, err := b.env.JS.PublishMsg(context.Background(), msg); err != nil {
		t.Fatal(err)
	}
	b.start(t, cfg)
	testenv.Eventually(t, 45*time.Second, "the refused message dead-lettered and its span ended", func() bool {
		return b.out.Get(idem.OutcomeDeadLettered) == 1 && len(rec.Ended()) == 1
	})
	sp := rec.Ended()[0]
	if sp.Status().Code != codes.Error || !strings.Contains(sp.Status().Description, "dead-lettered") {
		t.Errorf("span status %v %q, want Error naming the dead letter", sp.Status().Code, sp.Status().Description)
	}
	recorded := false
	for _, e := range sp.Events() {
		recorded = recorded || (e.Name == "exception" && strings.Contains(fmt.Sprint(e.Attributes), "refused the card"))
	}
	if !recorded {
		t.Errorf("the handler's error is not recorded on the span (events %v)", sp.Events())
	}
}
