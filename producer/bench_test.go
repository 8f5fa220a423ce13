package producer_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/install"
	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/producer"
)

// BenchmarkMiddleware is the ingress's hot path: a POST with a new key, through
// the middleware, whose handler writes one row and enqueues one message, and whose
// response is stored in the same transaction. No network: the request goes
// straight to the handler.
func BenchmarkMiddleware(b *testing.B) {
	db := pgtest.New(b)
	if _, err := db.Pool.Exec(b.Context(), `CREATE TABLE bench_orders (key text, body bytea)`); err != nil {
		b.Fatal(err)
	}
	inst, err := install.New(db.Pool, nil, install.Config{Stream: install.Stream{Name: "BENCH", Subjects: []string{"bench.>"}}})
	if err != nil {
		b.Fatal(err)
	}
	mw, err := producer.NewMiddleware(inst, producer.Config{})
	if err != nil {
		b.Fatal(err)
	}
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, _ := producer.IntentFrom(r.Context())
		if _, err := in.Tx.Exec(r.Context(), `INSERT INTO bench_orders VALUES ($1, $2)`, in.ScopedKey(), []byte("{}")); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if err := in.Enqueue(r.Context(), "bench.created", []byte("{}"), nil); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusAccepted)
	}))
	b.ResetTimer()
	for i := range b.N {
		r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"item":"book"}`))
		r.Header.Set(idem.HeaderKey, fmt.Sprintf("bench-%d", i))
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != http.StatusAccepted {
			b.Fatalf("status %d: %s", w.Code, w.Body)
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "requests/s")
}
