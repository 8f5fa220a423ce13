package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"
)

// press is one user intent a lane will make at offset at into the load: charge
// account by cents, or send an email to account@chaos.test. The account is unique
// per press, so the checker can tell whose effect a ledger row or a mail is.
type press struct {
	at      time.Duration
	email   bool
	account string
	cents   int64
	drop    bool // --drop-response: the first response is lost on the way back
}

func (p press) recipient() string { return p.account + "@chaos.test" }
func (p press) subject() string   { return "chaos " + p.account }

// args is the enqueue command line of the press.
func (p press) args() []string {
	var args []string
	if p.email {
		args = []string{"email", "--to", p.recipient(), "--subject", p.subject(), "--body", "intent " + p.account}
	} else {
		args = []string{"charge", "--account", p.account, "--amount-cents", strconv.FormatInt(p.cents, 10)}
	}
	if p.drop {
		args = append(args, "--drop-response")
	}
	return args
}

// lane is one client device: one journal, one enqueue process at a time (the journal
// is locked while in use), intents made at a steady pace over the load phase.
type lane struct {
	r       *run
	id      int
	journal string
	log     *os.File // stderr of every enqueue of this lane
	out     *os.File // stdout: one JSON line per intent
	rng     *rand.Rand
	presses []press

	until <-chan struct{} // closed: the lane makes no more presses (nil: it makes them all)

	mu     sync.Mutex
	killIn time.Duration // > 0: SIGKILL the next enqueue this long after it starts
}

func newLane(r *run, id int, presses []press, rng *rand.Rand) (*lane, error) {
	l := &lane{r: r, id: id, presses: presses, rng: rng,
		journal: filepath.Join(r.dir, "clients", fmt.Sprintf("lane%02d.journal", id))}
	var err error
	if l.log, err = r.procs.openLog(fmt.Sprintf("client-lane%02d", id)); err != nil {
		return nil, err
	}
	if l.out, err = os.OpenFile(filepath.Join(r.dir, fmt.Sprintf("client-lane%02d.out", id)), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err != nil {
		return nil, fmt.Errorf("chaos: lane %d output: %w", id, err)
	}
	return l, nil
}

// armKill makes the lane's next enqueue die of SIGKILL delay after it starts: a
// client killed mid-request (or mid-resume).
func (l *lane) armKill(delay time.Duration) {
	l.mu.Lock()
	l.killIn = delay
	l.mu.Unlock()
}

// enqueue runs one enqueue command to its end and returns the process.
func (l *lane) enqueue(ctx context.Context, args ...string) (*proc, error) {
	args = append(args, "--journal", l.journal, "--api", l.r.ingressURL(l.rng),
		"--max-attempts", "5", "--timeout", "3s")
	fmt.Fprintf(l.log, "=== chaos: enqueue %v\n", args)
	p, err := l.r.procs.start(fmt.Sprintf("enqueue-lane%02d", l.id), l.log, l.out, nil, enqueueBin, args...)
	if err != nil {
		return nil, err
	}
	l.mu.Lock()
	delay := l.killIn
	l.killIn = 0
	l.mu.Unlock()
	var timer *time.Timer
	if delay > 0 {
		timer = time.AfterFunc(delay, p.kill)
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		p.kill()
		<-p.done
	}
	if timer != nil {
		timer.Stop()
		if p.killed() {
			l.r.faults.clientKills.Add(1)
			l.r.logf("fault: client lane %d: enqueue %s SIGKILLed %s after start", l.id, args[0], delay)
		}
	}
	fmt.Fprintf(l.log, "=== chaos: enqueue %s: %s\n", args[0], p.outcome())
	return p, nil
}

// runLoad makes the lane's intents at their moments. A charge that did not finish
// (killed, or attempts exhausted while its ingress was down) leaves the intent
// pending in the journal; the lane resumes before its next intent, as an app does
// when it comes back.
func (l *lane) runLoad(ctx context.Context, start time.Time) error {
	needResume := false
	for i, pr := range l.presses {
		select {
		case <-time.After(time.Until(start.Add(pr.at))): // the pace of the user
		case <-l.until:
			return nil // what is pending, finish resumes
		case <-ctx.Done():
			return ctx.Err()
		}
		if needResume {
			p, err := l.enqueue(ctx, "resume")
			if err != nil {
				return err
			}
			needResume = p.exitCode() != 0
		}
		p, err := l.enqueue(ctx, pr.args()...)
		if err != nil {
			return fmt.Errorf("lane %d press %d: %w", l.id, i, err)
		}
		if p.exitCode() != 0 {
			needResume = true
		}
	}
	return nil
}

// finish resumes until every intent in the journal is done (or ctx ends).
func (l *lane) finish(ctx context.Context) error {
	for attempt := 1; ; attempt++ {
		p, err := l.enqueue(ctx, "resume")
		if err != nil {
			return err
		}
		if p.exitCode() == 0 {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("lane %d: journal still not done after %d resumes: %w", l.id, attempt, ctx.Err())
		}
		select { // a client's back-off between resumes
		case <-time.After(500 * time.Millisecond):
		case <-ctx.Done():
		}
	}
}

// intentLine is one line of `enqueue list`.
type intentLine struct {
	Key        string          `json:"key"`
	Attempts   int             `json:"attempts"`
	Status     string          `json:"status"`
	HTTPStatus int             `json:"http_status"`
	Response   json.RawMessage `json:"response"`
}

// kind says what the intent was, from the response the client journaled:
// "charge" (it has a payment_id), "email" (an email_id), or "" (no response).
func (il intentLine) kind() string {
	var r struct {
		PaymentID *int64 `json:"payment_id"`
		EmailID   *int64 `json:"email_id"`
	}
	if json.Unmarshal(il.Response, &r) != nil {
		return ""
	}
	switch {
	case r.PaymentID != nil:
		return "charge"
	case r.EmailID != nil:
		return "email"
	}
	return ""
}

// list reads the journal through the client's own contract, `enqueue list`.
func (l *lane) list(ctx context.Context) ([]intentLine, error) {
	path := filepath.Join(l.r.dir, fmt.Sprintf("client-lane%02d.list", l.id))
	out, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("chaos: lane %d list: %w", l.id, err)
	}
	defer out.Close()
	p, err := l.r.procs.start(fmt.Sprintf("enqueue-list-lane%02d", l.id), l.log, out, nil, enqueueBin, "list", "--journal", l.journal)
	if err != nil {
		return nil, err
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		p.kill()
		<-p.done
		return nil, ctx.Err()
	}
	if code := p.exitCode(); code != 0 && code != 2 { // 2: some intent not done; the checker says which
		return nil, fmt.Errorf("chaos: lane %d: enqueue list: %s", l.id, p.outcome())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("chaos: lane %d list: %w", l.id, err)
	}
	var lines []intentLine
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
	for sc.Scan() {
		var il intentLine
		if err := json.Unmarshal(sc.Bytes(), &il); err != nil {
			return nil, fmt.Errorf("chaos: lane %d: enqueue list printed %q: %w", l.id, sc.Text(), err)
		}
		lines = append(lines, il)
	}
	return lines, sc.Err()
}
