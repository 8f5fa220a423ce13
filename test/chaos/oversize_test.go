package chaos

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/idemkit/idem/client"
)

// The oversize presses: a client device (a lane with a journal of its own) whose
// presses send a charge with a body just under 1 MiB of valid JSON. The ingress
// must answer 413 before anything is written, the client must journal that as a
// final answer (rejected), and nothing may take effect. They go through the client
// library in the test process, not through the enqueue CLI: one argument of a
// command line is limited to 128 KiB on Linux, far below the body. The journal is
// read back with `enqueue list`, the client's contract, like the others.

// runOversize makes one oversize press at each offset of at into the load.
func (l *lane) runOversize(ctx context.Context, start time.Time, at []time.Duration) error {
	for i, d := range at {
		select {
		case <-time.After(time.Until(start.Add(d))): // the pace of the user
		case <-ctx.Done():
			return ctx.Err()
		}
		body := chargeOfSize(fmt.Sprintf("acct-big-%02d-", i), 100+int64(i), oversizeBodyBytes)
		if err := l.submitOversize(ctx, body); err != nil {
			return fmt.Errorf("oversize press %d: %w", i, err)
		}
	}
	return nil
}

// oversizeClient opens the lane's journal and a client on a random ingress. The
// caller closes the journal.
func (l *lane) oversizeClient(ctx context.Context) (*client.Client, *client.Journal, error) {
	j, err := client.OpenJournalContext(ctx, l.journal)
	if err != nil {
		return nil, nil, fmt.Errorf("oversize journal: %w", err)
	}
	c, err := client.New(client.Config{
		Store:       j,
		BaseURL:     l.r.ingressURL(l.rng),
		MaxAttempts: 5,
		Timeout:     10 * time.Second,
		Logger:      slog.New(slog.NewTextHandler(l.log, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	if err != nil {
		j.Close()
		return nil, nil, err
	}
	return c, j, nil
}

// submitOversize submits one oversize press. An intent left pending (its ingress
// was down, or Postgres was: the client cannot tell) is resumed by finishOversize.
func (l *lane) submitOversize(ctx context.Context, body []byte) error {
	c, j, err := l.oversizeClient(ctx)
	if err != nil {
		return err
	}
	defer j.Close()
	res, err := c.Submit(ctx, client.Request{Path: "/v1/payments", Body: body})
	fmt.Fprintf(l.log, "=== chaos: oversize press of %d bytes: key %s %s http %d after %d attempts (err %v)\n",
		len(body), res.Key, res.Status, res.HTTPStatus, res.Attempts, err)
	if err != nil && !errors.Is(err, client.ErrStillPending) {
		return err
	}
	return nil
}

// finishOversize resumes the oversize journal until no intent in it is pending.
func (l *lane) finishOversize(ctx context.Context) error {
	for attempt := 1; ; attempt++ {
		c, j, err := l.oversizeClient(ctx)
		if err != nil {
			return err
		}
		results, err := c.Resume(ctx, nil)
		j.Close()
		pending := 0
		for _, r := range results {
			if r.Status == client.IntentPending {
				pending++
			}
		}
		fmt.Fprintf(l.log, "=== chaos: oversize resume: %d intents, %d still pending (err %v)\n", len(results), pending, err)
		if pending == 0 && (err == nil || errors.Is(err, client.ErrStillPending)) {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("oversize journal still has %d pending intents after %d resumes: %w", pending, attempt, ctx.Err())
		}
		select { // a client's back-off between resumes
		case <-time.After(500 * time.Millisecond):
		case <-ctx.Done():
		}
	}
}
