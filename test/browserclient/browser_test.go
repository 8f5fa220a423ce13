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
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
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
	Status     int    `json:"status"`
	RetryAfter string `json:"retryAfter"`
	Location   string `json:"location"`
	DelayMs    int    `json:"delayMs"`
	Body       string `json:"body"`
}

// scripted is the test server's endpoint: queued answers and the keys it saw.
type scripted struct {
	mu      sync.Mutex
	answers map[string][]answer
	seen    map[string][]string
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
		keys := append([]string{}, s.seen[r.PathValue("name")]...)
		s.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(keys)
	})
	mux.HandleFunc("/do/{name}", func(w http.ResponseWriter, r *http.Request) {
		name := r.PathValue("name")
		s.mu.Lock()
		s.seen[name] = append(s.seen[name], r.Header.Get("Idempotency-Key"))
		a := answer{Status: http.StatusOK, Body: `{"ok":true}`}
		if q := s.answers[name]; len(q) > 0 {
			a, s.answers[name] = q[0], q[1:]
		}
		s.mu.Unlock()
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
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(a.Status)
		_, _ = w.Write([]byte(a.Body))
	})
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
	(&scripted{answers: map[string][]answer{}, seen: map[string][]string{}}).routes(mux)
	files := http.FileServerFS(os.DirFS(packageDir()))
	mux.Handle("GET /src/", files)
	mux.Handle("GET /test/browser/", files)
	// 127.0.0.1 is a secure context, as Web Locks need.
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	tctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	start := time.Now()
	if err := chromedp.Do(tctx, chromedp.Navigate(srv.URL+"/test/browser/index.html")); err != nil {
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
