package browsertest

import (
	"net"
	"net/http"
	"sync"
	"testing"
)

// CORSMode is how a CORSGate answers a page of another origin.
type CORSMode string

const (
	// CORSNone adds nothing: the service behind answers the preflight itself, as
	// a service without CORS does (the browser then sends nothing).
	CORSNone CORSMode = "none"
	// CORSPreflightOnly answers the preflight, but leaves
	// Access-Control-Allow-Origin off the actual response: the service runs the
	// request, and the browser hides its answer from the page.
	CORSPreflightOnly CORSMode = "preflight"
	// CORSFull follows the browser client's CORS contract.
	CORSFull CORSMode = "full"
)

// CORSGate is the CORS configuration in front of a service, switchable while
// a test runs: the misconfigurations a deployment makes, and the fix.
type CORSGate struct {
	mu   sync.Mutex
	mode CORSMode
}

// NewCORSGate starts in mode.
func NewCORSGate(mode CORSMode) *CORSGate { return &CORSGate{mode: mode} }

// Set switches the gate to mode.
func (g *CORSGate) Set(mode CORSMode) {
	g.mu.Lock()
	g.mode = mode
	g.mu.Unlock()
}

// Wrap puts the gate in front of next.
func (g *CORSGate) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.mu.Lock()
		mode := g.mode
		g.mu.Unlock()
		origin := r.Header.Get("Origin")
		if mode == CORSNone || origin == "" {
			next.ServeHTTP(w, r)
			return
		}
		h := w.Header()
		if r.Method == http.MethodOptions && r.Header.Get("Access-Control-Request-Method") != "" {
			h.Set("Access-Control-Allow-Origin", origin)
			h.Set("Access-Control-Allow-Methods", "POST")
			h.Set("Access-Control-Allow-Headers", "Idempotency-Key, Idempotency-Scope, Content-Type")
			w.WriteHeader(http.StatusNoContent)
			return
		}
		if mode == CORSFull {
			h.Set("Access-Control-Allow-Origin", origin)
			h.Set("Access-Control-Expose-Headers", "Idempotent-Replayed, Retry-After, Date")
		}
		next.ServeHTTP(w, r)
	})
}

// ClosedOrigin is an http origin on loopback where nothing listens: a page's
// requests to it fail as in an outage.
func ClosedOrigin(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	origin := "http://" + ln.Addr().String()
	ln.Close()
	return origin
}
