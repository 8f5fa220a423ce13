package client_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/client"
)

// A client submits a payment. The ingress charges on the first request, but the
// answer is lost on the way back (a proxy in front of it answers 503), so the client
// sends again with the same key and the ingress replays its first answer instead of
// charging twice.
func ExampleClient_Submit() {
	// A stand-in for the idem ingress: the first request with a key executes, a
	// repeat gets the first response again, marked as replayed.
	var mu sync.Mutex
	first := map[string]string{} // key -> first response body
	var keys []string            // Idempotency-Key of every request, in order
	charges := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		defer mu.Unlock()
		key := r.Header.Get(idem.HeaderKey)
		keys = append(keys, key)
		if body, ok := first[key]; ok {
			w.Header().Set(idem.HeaderReplayed, "true")
			w.WriteHeader(http.StatusAccepted)
			fmt.Fprint(w, body)
			return
		}
		charges++
		first[key] = fmt.Sprintf(`{"id":"pay_%d"}`, charges)
		if len(keys) == 1 {
			// The charge is committed, but the client never hears of it.
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusAccepted)
		fmt.Fprint(w, first[key])
	}))
	defer srv.Close()

	dir, err := os.MkdirTemp("", "idem-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	// The journal is where the key lives from before the first send until the
	// response is recorded.
	journal, err := client.OpenJournal(filepath.Join(dir, "client.journal"))
	if err != nil {
		log.Fatal(err)
	}
	defer journal.Close()

	c, err := client.New(client.Config{Store: journal, BaseURL: srv.URL})
	if err != nil {
		log.Fatal(err)
	}
	res, err := c.Submit(context.Background(), client.Request{
		Path: "/v1/payments",
		Body: []byte(`{"account":"acct_1","amount_cents":1250}`),
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("status:", res.Status, res.HTTPStatus)
	fmt.Println("attempts:", res.Attempts, "replayed:", res.Replayed)
	fmt.Println("response:", string(res.Response))
	mu.Lock()
	fmt.Println("same key on both sends:", len(keys) == 2 && keys[0] == keys[1] && keys[0] == string(res.Key))
	fmt.Println("charges on the server:", charges)
	mu.Unlock()
	pending, err := journal.Pending(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("pending in the journal:", len(pending))
	// Output:
	// status: done 202
	// attempts: 2 replayed: true
	// response: {"id":"pay_1"}
	// same key on both sends: true
	// charges on the server: 1
	// pending in the journal: 0
}

// The service is down, the client gives up and the process exits with the intent
// still pending. After the restart, Resume finds it in the journal and sends it with
// the key it was minted with.
func ExampleClient_Resume() {
	var down atomic.Bool
	down.Store(true)
	var mu sync.Mutex
	var keys []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		keys = append(keys, r.Header.Get(idem.HeaderKey))
		mu.Unlock()
		if down.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusAccepted)
		fmt.Fprint(w, `{"id":"pay_1"}`)
	}))
	defer srv.Close()

	dir, err := os.MkdirTemp("", "idem-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "client.journal")

	// The first run: one attempt, a 503, and the intent stays pending.
	journal, err := client.OpenJournal(path)
	if err != nil {
		log.Fatal(err)
	}
	c, err := client.New(client.Config{Store: journal, BaseURL: srv.URL, MaxAttempts: 1})
	if err != nil {
		log.Fatal(err)
	}
	res, err := c.Submit(context.Background(), client.Request{
		Path: "/v1/payments",
		Body: []byte(`{"account":"acct_1","amount_cents":1250}`),
	})
	fmt.Println("first run:", res.Status, "still pending:", errors.Is(err, client.ErrStillPending))
	if err := journal.Close(); err != nil { // the process exits
		log.Fatal(err)
	}

	// The restart: a new process opens the same journal.
	down.Store(false)
	journal, err = client.OpenJournal(path)
	if err != nil {
		log.Fatal(err)
	}
	defer journal.Close()
	c, err = client.New(client.Config{Store: journal, BaseURL: srv.URL})
	if err != nil {
		log.Fatal(err)
	}
	results, err := c.Resume(context.Background(), nil)
	if err != nil {
		log.Fatal(err)
	}
	for _, r := range results {
		fmt.Println("after restart:", r.Status, r.HTTPStatus, "attempts:", r.Attempts, "same key:", r.Key == res.Key)
	}
	mu.Lock()
	fmt.Println("keys sent:", len(keys), "distinct:", len(map[string]bool{keys[0]: true, keys[len(keys)-1]: true}))
	mu.Unlock()
	// Output:
	// first run: pending still pending: true
	// after restart: done 202 attempts: 2 same key: true
	// keys sent: 2 distinct: 1
}
