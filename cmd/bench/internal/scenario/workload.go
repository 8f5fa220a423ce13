package scenario

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/app/refapp"
	"github.com/idemkit/idem/cmd/bench/internal/benchenv"
	"github.com/idemkit/idem/cmd/bench/internal/measure"
	"github.com/idemkit/idem/cmd/bench/internal/report"
)

// prefillWindow is how many publishes prefill leaves unacknowledged at most.
const prefillWindow = 1000

// intent is one charge the benchmark submits.
type intent struct {
	Key     string
	Account string
	Amount  int64
	Payload []byte
}

// makeIntents mints n intents with fresh keys and JSON charge payloads, the body of
// POST /v1/payments: small ones, or about payloadBytes each (the account name is
// padded: the charge stays valid) to measure memory with large messages.
func makeIntents(n, payloadBytes int) []intent {
	out := make([]intent, n)
	pad := ""
	if overhead := len(`{"account":"acct_000_","amount_cents":1000}`); payloadBytes > overhead {
		pad = "_" + strings.Repeat("p", payloadBytes-overhead)
	}
	for i := range out {
		acct := "acct_" + strconv.Itoa(i%1000) + pad
		amount := int64(100 + i%9000)
		out[i] = intent{
			Key:     idem.NewKey().String(),
			Account: acct,
			Amount:  amount,
			Payload: fmt.Appendf(nil, `{"account":%q,"amount_cents":%d}`, acct, amount),
		}
	}
	return out
}

// message is the outbox message of the intent, with no extra headers: the relay
// adds Idempotency-Key and Nats-Msg-Id. The key carries no scope, so it is its own
// scoped key, as the ingress would stamp it for a request without Idempotency-Scope.
func (in intent) message() idem.Message {
	return idem.Message{Key: in.Key, Subject: refapp.SubjectCharge, Payload: in.Payload}
}

// indexByKey maps each intent's key to its index, so the benchmark can match a
// committed delivery with the time its intent was enqueued without adding anything
// to the message. It is only read once built, so goroutines may share it.
func indexByKey(intents []intent) map[string]int {
	m := make(map[string]int, len(intents))
	for i, in := range intents {
		m[in.Key] = i
	}
	return m
}

// prefill publishes one message per intent to the stream, exactly as the relay
// would (Idempotency-Key and Nats-Msg-Id headers), and waits for every PubAck. It
// publishes in windows of prefillWindow so a busy machine never stalls the client's
// async publish buffer. It is not timed.
func prefill(ctx context.Context, env *benchenv.Env, scenario string, intents []intent) error {
	start := time.Now()
	for lo := 0; lo < len(intents); lo += prefillWindow {
		for i := lo; i < min(lo+prefillWindow, len(intents)); i++ {
			in := intents[i]
			m := nats.NewMsg(refapp.SubjectCharge)
			m.Header.Set(idem.HeaderKey, in.Key)
			m.Header.Set(jetstream.MsgIDHeader, idem.MsgID(refapp.SubjectCharge, in.Key))
			m.Data = in.Payload
			if _, err := env.JS.PublishMsgAsync(m); err != nil {
				return fmt.Errorf("prefill: publish %d: %w", i, err)
			}
		}
		select {
		case <-env.JS.PublishAsyncComplete():
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Minute):
			return fmt.Errorf("prefill: %d PubAcks still pending after a minute", env.JS.PublishAsyncPending())
		}
	}
	info, err := env.Stream.Info(ctx)
	if err != nil {
		return fmt.Errorf("prefill: stream info: %w", err)
	}
	if info.State.Msgs != uint64(len(intents)) {
		return fmt.Errorf("prefill: stream holds %d messages, published %d", info.State.Msgs, len(intents))
	}
	fmt.Fprintf(os.Stderr, "[%s] stream pre-filled with %d messages in %s\n", scenario, len(intents), time.Since(start).Round(time.Millisecond))
	return nil
}

// readLedger reads what ledger_entries holds.
func readLedger(ctx context.Context, env *benchenv.Env) (report.Ledger, error) {
	var l report.Ledger
	err := env.Pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT idempotency_key) FROM ledger_entries`).Scan(&l.Rows, &l.Keys)
	if err != nil {
		return l, fmt.Errorf("read ledger: %w", err)
	}
	return l, nil
}

// verifyExactlyOnce fails unless the ledger holds exactly one row per intent.
func verifyExactlyOnce(ctx context.Context, env *benchenv.Env, n int) (report.Ledger, error) {
	l, err := readLedger(ctx, env)
	if err != nil {
		return l, err
	}
	if l.Rows != n || l.Keys != n {
		return l, fmt.Errorf("VERIFY FAILED: ledger has %d rows with %d distinct keys, want %d and %d", l.Rows, l.Keys, n, n)
	}
	return l, nil
}

// progress prints done/total to stderr every two seconds until ctx is done.
func progress(ctx context.Context, scenario, what string, total int, done func() int64) {
	start := time.Now()
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			d := done()
			fmt.Fprintf(os.Stderr, "[%s] %s %d/%d (%.0f/s)\n", scenario, what, d, total, float64(d)/time.Since(start).Seconds())
		}
	}
}

// timedRun runs run (a consumer's or a relay's Run) until c reaches its target,
// printing progress as verb, and returns what env's meter measured from run's
// start to the target. run is stopped before timedRun returns.
func timedRun(ctx context.Context, env *benchenv.Env, timeout time.Duration, name, verb string, c *counter, run func(context.Context) error) (measure.Measurement, error) {
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go progress(runCtx, name, verb, int(c.target), c.Load)

	meter, err := env.StartMeter(ctx)
	if err != nil {
		return measure.Measurement{}, err
	}
	runErr := make(chan error, 1)
	go func() { runErr <- run(runCtx) }()
	waitErr := c.wait(ctx, timeout, verb)
	meas, merr := meter.Stop(ctx)
	cancel()
	if err := <-runErr; err != nil {
		return measure.Measurement{}, fmt.Errorf("%s: %w", name, err)
	}
	if waitErr != nil {
		return measure.Measurement{}, fmt.Errorf("%s: %w", name, waitErr)
	}
	return meas, merr
}

// counter counts up to a target and closes Done when it gets there.
type counter struct {
	n      atomic.Int64
	target int64
	done   chan struct{}
	closed atomic.Bool
}

func newCounter(target int) *counter {
	return &counter{target: int64(target), done: make(chan struct{})}
}

func (c *counter) Add(d int) {
	if c.n.Add(int64(d)) >= c.target && c.closed.CompareAndSwap(false, true) {
		close(c.done)
	}
}

func (c *counter) Load() int64 { return c.n.Load() }

// wait blocks until the counter reaches its target, ctx is done, or timeout.
func (c *counter) wait(ctx context.Context, timeout time.Duration, what string) error {
	select {
	case <-c.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(timeout):
		return fmt.Errorf("timed out after %s: %s %d of %d", timeout, what, c.Load(), c.target)
	}
}

// waitDrained waits until the durable consumer has nothing pending or unacked: every
// ack the scenario sent has reached the broker.
func waitDrained(ctx context.Context, env *benchenv.Env, durable string, timeout time.Duration) (*jetstream.ConsumerInfo, error) {
	deadline := time.Now().Add(timeout)
	for {
		c, err := env.JS.Consumer(ctx, refapp.StreamName, durable)
		if err != nil {
			return nil, fmt.Errorf("consumer %s: %w", durable, err)
		}
		info, err := c.Info(ctx)
		if err != nil {
			return nil, fmt.Errorf("consumer %s info: %w", durable, err)
		}
		if info.NumPending == 0 && info.NumAckPending == 0 {
			return info, nil
		}
		if time.Now().After(deadline) {
			return info, fmt.Errorf("consumer %s not drained after %s: %d pending, %d unacked", durable, timeout, info.NumPending, info.NumAckPending)
		}
		select {
		case <-ctx.Done():
			return info, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
