package producer_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/producer"
)

// A client submits a payment. The first response is lost on the way back (a fault
// switch for demonstrations), so the client sends again with the same key and the
// server replays its first answer instead of charging twice.
func ExampleClient_Submit() {
	// A stand-in for the idem ingress: the first request with a key executes, a
	// repeat gets the first response again, marked as replayed.
	var mu sync.Mutex
	first := map[string]string{}
	charges := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		defer mu.Unlock()
		key := r.Header.Get(idem.HeaderKey)
		if body, ok := first[key]; ok {
			w.Header().Set(idem.HeaderReplayed, "true")
			w.WriteHeader(http.StatusAccepted)
			fmt.Fprint(w, body)
			return
		}
		charges++
		first[key] = fmt.Sprintf(`{"id":"pay_%d"}`, charges)
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
	journal, err := producer.Open(filepath.Join(dir, "client.journal"))
	if err != nil {
		log.Fatal(err)
	}
	defer journal.Close()

	client, err := producer.NewClient(producer.ClientConfig{Journal: journal, BaseURL: srv.URL})
	if err != nil {
		log.Fatal(err)
	}
	res, err := client.Submit(context.Background(), producer.Request{
		Path:              "/v1/payments",
		Body:              []byte(`{"account":"acct_1","amount_cents":1250}`),
		DropFirstResponse: true,
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("status:", res.Status, res.HTTPStatus)
	fmt.Println("attempts:", res.Attempts, "replayed:", res.Replayed)
	fmt.Println("response:", string(res.Response))
	mu.Lock()
	fmt.Println("charges on the server:", charges)
	mu.Unlock()
	fmt.Println("pending in the journal:", len(journal.Pending()))
	// Output:
	// status: done 202
	// attempts: 2 replayed: true
	// response: {"id":"pay_1"}
	// charges on the server: 1
	// pending in the journal: 0
}
