package consumer_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
)

// An external effect in a few lines: a confirmation sent to a downstream HTTP
// service that honours an Idempotency-Key. The key comes from the intent's
// (e.KeyFor), so every attempt presents the same one; a 2xx is the result, a
// refusal no retry can fix is Permanent (dead-lettered), anything else is
// retried. Give it to a consumer as its External handler:
//
//	consumer.Config{Name: "confirm", Subject: "orders.created", External: confirm}
//
// The consumer runs it under a lease: one effect at a time by default, and the
// effect of a worker that died mid-way is taken over when its lease runs out
// (LeaseFor, 30 s by default), with the same key. Here Perform is called directly,
// as the consumer calls it on a first attempt and on a retry after a crash.
func ExampleExternalHandlerFunc() {
	downstream := &confirmations{done: map[string]string{}}
	srv := httptest.NewServer(downstream)
	defer srv.Close()

	confirm := consumer.ExternalHandlerFunc(func(ctx context.Context, e *consumer.Effect) ([]byte, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/confirmations", bytes.NewReader(e.Payload))
		if err != nil {
			return nil, consumer.Permanent(err)
		}
		req.Header.Set("Idempotency-Key", e.KeyFor("confirm")) // the same on every attempt
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return nil, err // the downstream may have got it: retried, with the same key
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		switch {
		case resp.StatusCode < 300:
			return body, nil // stored as the key's result
		case resp.StatusCode < 500 && resp.StatusCode != http.StatusConflict && resp.StatusCode != http.StatusTooManyRequests:
			return nil, consumer.Permanent(fmt.Errorf("confirm: %s: %s", resp.Status, body))
		default:
			return nil, fmt.Errorf("confirm: %s", resp.Status) // retried after a backoff
		}
	})

	ctx := context.Background()
	order := &consumer.Effect{Delivery: &consumer.Delivery{Message: idem.Message{Key: "k-1", Payload: []byte(`{"order":42}`)}}}
	for attempt := 1; attempt <= 2; attempt++ { // a first attempt, and a retry after a crash
		order.Attempt = attempt
		result, err := confirm.Perform(ctx, order)
		fmt.Printf("attempt %d: %s %v\n", attempt, result, err)
	}
	bad := &consumer.Effect{Delivery: &consumer.Delivery{Message: idem.Message{Key: "k-2", Payload: []byte(`not json`)}}}
	_, err := confirm.Perform(ctx, bad)
	fmt.Println("bad payload, permanent:", consumer.IsPermanent(err))
	fmt.Println("confirmations executed:", downstream.executed())

	cfg := consumer.Config{Name: "confirm", Subject: "orders.created", External: confirm}.WithDefaults()
	fmt.Println("concurrency:", cfg.Concurrency, "lease:", cfg.LeaseFor)
	// Output:
	// attempt 1: {"confirmation":1} <nil>
	// attempt 2: {"confirmation":1} <nil>
	// bad payload, permanent: true
	// confirmations executed: 1
	// concurrency: 1 lease: 30s
}

// confirmations is the example's downstream: it executes a key's first request and
// answers a repeat with the first answer, and refuses a body that is not JSON.
type confirmations struct {
	mu   sync.Mutex
	done map[string]string // Idempotency-Key -> the answer
}

func (c *confirmations) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	if !bytes.HasPrefix(body, []byte("{")) {
		http.Error(w, "not an order", http.StatusBadRequest)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	key := r.Header.Get("Idempotency-Key")
	if _, ok := c.done[key]; !ok {
		c.done[key] = fmt.Sprintf(`{"confirmation":%d}`, len(c.done)+1)
	}
	fmt.Fprint(w, c.done[key])
}

func (c *confirmations) executed() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.done)
}
