// Package browserclient_test runs the browser client's in-browser tests
// (clients/browser/test/browser: the IndexedDB journal and the retry loop) in
// headless Chromium against a scripted HTTP server. They live in this module, not
// in clients/browser's, so that chromedp stays out of the graph of every module
// that embeds the client (the reference application and its commands).
//
// Without Chromium the test skips, unless IDEM_REQUIRE_BROWSER=1 (CI), where it
// fails.
package browserclient_test

import (
	"cmp"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/idemkit/idem/test/internal/browsertest"
)

// answer is one scripted response of the test server.
type answer struct {
	Status      int    `json:"status"`
	RetryAfter  string `json:"retryAfter"`
	Location    string `json:"location"`
	DelayMs     int    `json:"delayMs"`
	Body        string `json:"body"`
	ContentType string `json:"contentType"`
}

// request is what the test server saw of one request.
type request struct {
	Key           string `json:"key"`
	Method        string `json:"method"`
	ContentType   string `json:"contentType"`
	Authorization string `json:"authorization"`
	Test          string `json:"test"` // the X-Test header
	Body          string `json:"body"`
}

// scripted is the test server's endpoint: queued answers, the requests it saw,
// and how many it had in flight at once.
type scripted struct {
	mu       sync.Mutex
	answers  map[string][]answer
	seen     map[string][]request
	inFlight map[string]int
	maxIn    map[string]int
}

func newScripted() *scripted {
	return &scripted{answers: map[string][]answer{}, seen: map[string][]request{}, inFlight: map[string]int{}, maxIn: map[string]int{}}
}

func (s *scripted) routes(mux *http.ServeMux) {
	mux.HandleFunc("POST /script/{name}", func(w http.ResponseWriter, r *http.Request) {
		var as []answer
		if err := json.NewDecoder(r.Body).Decode(&as); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		s.mu.Lock()
		s.answers[r.PathValue("name")] = append(s.answers[r.PathValue("name")], as...)
		s.mu.Unlock()
	})
	mux.HandleFunc("GET /seen/{name}", func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		keys := []string{}
		for _, q := range s.seen[r.PathValue("name")] {
			keys = append(keys, q.Key)
		}
		s.mu.Unlock()
		writeJSON(w, keys)
	})
	mux.HandleFunc("GET /requests/{name}", func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		rs := append([]request{}, s.seen[r.PathValue("name")]...)
		s.mu.Unlock()
		writeJSON(w, rs)
	})
	mux.HandleFunc("GET /inflight/{name}", func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		n := s.maxIn[r.PathValue("name")]
		s.mu.Unlock()
		writeJSON(w, n)
	})
	mux.HandleFunc("/do/{name}", func(w http.ResponseWriter, r *http.Request) {
		name := r.PathValue("name")
		if r.Method == http.MethodGet || r.Method == http.MethodOptions {
			// A client's reachability probe (a no-cors GET), or a preflight the gate
			// let through: no intent, no answer of the script.
			w.WriteHeader(http.StatusMethodNotAllowed)
			return
		}
		body, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.seen[name] = append(s.seen[name], request{
			Key: r.Header.Get("Idempotency-Key"), Method: r.Method, ContentType: r.Header.Get("Content-Type"),
			Authorization: r.Header.Get("Authorization"), Test: r.Header.Get("X-Test"), Body: string(body),
		})
		s.inFlight[name]++
		s.maxIn[name] = max(s.maxIn[name], s.inFlight[name])
		a := answer{Status: http.StatusOK, Body: `{"ok":true}`}
		if q := s.answers[name]; len(q) > 0 {
			a, s.answers[name] = q[0], q[1:]
		}
		s.mu.Unlock()
		defer func() {
			s.mu.Lock()
			s.inFlight[name]--
			s.mu.Unlock()
		}()
		if a.DelayMs > 0 {
			select {
			case <-r.Context().Done():
				return
			case <-time.After(time.Duration(a.DelayMs) * time.Millisecond):
			}
		}
		if a.RetryAfter != "" {
			w.Header().Set("Retry-After", a.RetryAfter)
		}
		if a.Location != "" {
			w.Header().Set("Location", a.Location)
		}
		w.Header().Set("Content-Type", cmp.Or(a.ContentType, "application/json"))
		w.WriteHeader(a.Status)
		_, _ = w.Write([]byte(a.Body))
	})
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// packageDir is clients/browser, the npm package.
func packageDir() string {
	_, here, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(here), "..", "..", "clients", "browser")
}

// TestInBrowser runs clients/browser/test/browser/run.js, the journal's and the
// retry loop's tests, in headless Chromium against the scripted server.
func TestInBrowser(t *testing.T) {
	t.Parallel()
	ctx := browsertest.New(t)
	mux := http.NewServeMux()
	endpoint := newScripted()
	endpoint.routes(mux)
	files := http.FileServerFS(os.DirFS(packageDir()))
	mux.Handle("GET /src/", files)
	mux.Handle("GET /test/browser/", files)
	gate := browsertest.NewCORSGate(browsertest.CORSNone)
	mux.HandleFunc("POST /cors/{mode}", func(w http.ResponseWriter, r *http.Request) {
		gate.Set(browsertest.CORSMode(r.PathValue("mode")))
	})
	// 127.0.0.1 is a secure context, as Web Locks need.
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	// Another origin (another port) serving the same endpoint behind the gate.
	other := httptest.NewServer(gate.Wrap(mux))
	t.Cleanup(other.Close)
	down := browsertest.ClosedOrigin(t)

	tctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	start := time.Now()
	if err := chromedp.Do(tctx, chromedp.Navigate(srv.URL+"/test/browser/index.html?"+url.Values{"other": {other.URL}, "down": {down}}.Encode())); err != nil {
		t.Fatal(err)
	}
	type result struct {
		Name  string `json:"name"`
		OK    bool   `json:"ok"`
		Error string `json:"error"`
	}
	results, err := chromedp.Run(tctx, chromedp.Evaluate[[]result](`window.idemTests`, chromedp.EvalAwaitPromise))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d browser tests in %v", len(results), time.Since(start).Round(time.Millisecond))
	if len(results) == 0 {
		t.Fatal("the page ran no test")
	}
	for _, r := range results {
		if r.OK {
			t.Logf("ok   %s", r.Name)
		} else {
			t.Errorf("FAIL %s\n%s", r.Name, r.Error)
		}
	}
}
