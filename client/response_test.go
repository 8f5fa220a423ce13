package client

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
)

// redirector answers every POST to /v1/payments with a redirect to
// /v1/payments/pay_1, and anything else with 200: a follow-up request, if the client
// made one, would "succeed".
type redirector struct {
	srv  *httptest.Server
	code int

	mu       sync.Mutex
	requests []string // method and path of every request
}

func newRedirector(t *testing.T, code int) *redirector {
	r := &redirector{code: code}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.Copy(io.Discard, req.Body)
		r.mu.Lock()
		r.requests = append(r.requests, req.Method+" "+req.URL.Path)
		r.mu.Unlock()
		if req.Method == http.MethodPost && req.URL.Path == "/v1/payments" {
			w.Header().Set("Location", "/v1/payments/pay_1")
			w.WriteHeader(r.code)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"ok":true}`))
	}))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *redirector) seen() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.requests...)
}

// A redirect is not the service's answer to the POST: net/http would follow a 303
// with a GET (or re-send the POST elsewhere on a 307 or 308) and the client would
// journal that request's 200 as the intent done. The client never follows one, with
// its own http.Client or the caller's: the intent stays pending with the reason in
// Result.Error and the error wrapping ErrRedirected, Submit stops at once (the same
// URL gives the same redirect), and the caller's http.Client is left as it was.
func TestClientDoesNotFollowRedirects(t *testing.T) {
	for _, code := range []int{http.StatusMovedPermanently, http.StatusFound, http.StatusSeeOther,
		http.StatusTemporaryRedirect, http.StatusPermanentRedirect} {
		for _, own := range []bool{false, true} {
			name := fmt.Sprintf("%d/default-client", code)
			if own {
				name = fmt.Sprintf("%d/callers-client", code)
			}
			t.Run(name, func(t *testing.T) {
				r := newRedirector(t, code)
				j := openJournalT(t, filepath.Join(t.TempDir(), "j"))
				cfg := Config{Store: j, BaseURL: r.srv.URL, MaxAttempts: 3}
				var callersHook int
				var hc *http.Client
				if own {
					hc = &http.Client{
						Transport: &http.Transport{DisableKeepAlives: true},
						CheckRedirect: func(*http.Request, []*http.Request) error {
							callersHook++
							return nil // follow
						},
					}
					cfg.HTTPClient = hc
				}
				before := callersClient(hc)
				c := newClientT(t, cfg)

				res, err := c.Submit(t.Context(), payment)
				if !errors.Is(err, ErrStillPending) || !errors.Is(err, ErrRedirected) {
					t.Fatalf("Submit: err = %v, want ErrStillPending and ErrRedirected", err)
				}
				if res.Status != IntentPending || res.Attempts != 1 || res.HTTPStatus != 0 {
					t.Fatalf("result = %+v, want pending after 1 attempt, no final HTTP status", res)
				}
				if !strings.Contains(res.Error, fmt.Sprint(code)) || !strings.Contains(res.Error, "/v1/payments/pay_1") ||
					!strings.Contains(res.Error, "redirect") {
					t.Fatalf("Result.Error = %q, want it to name the redirect, HTTP %d and its Location", res.Error, code)
				}
				if got, want := r.seen(), []string{"POST /v1/payments"}; !reflect.DeepEqual(got, want) {
					t.Fatalf("server saw %q, want only %q: the redirect was followed", got, want)
				}
				if in, _ := j.Get(res.Key); in.Status != IntentPending || in.Attempts != 1 {
					t.Fatalf("journal = %+v, want still pending for Resume, 1 attempt", in)
				}
				if own {
					if callersHook != 0 {
						t.Fatalf("the caller's CheckRedirect was called %d times", callersHook)
					}
					if after := callersClient(hc); after != before {
						t.Fatalf("New changed the caller's http.Client: %s -> %s", before, after)
					}
				}
			})
		}
	}
}

// callersClient describes an http.Client's fields, to tell whether New changed it.
func callersClient(hc *http.Client) string {
	if hc == nil {
		return "nil"
	}
	return fmt.Sprintf("transport=%p check=%v jar=%v timeout=%v",
		hc.Transport, reflect.ValueOf(hc.CheckRedirect).Pointer(), hc.Jar, hc.Timeout)
}

// 425 Too Early, like 408 and 429, is the server asking to come back later; the
// server never stores it as the key's answer. It is retried with the same key.
func TestClientRetriesTooEarly(t *testing.T) {
	f := newFakeIngress(t)
	f.fail = func(n int, w http.ResponseWriter, _ *http.Request, _ []byte) bool {
		if n > 1 {
			return false
		}
		w.WriteHeader(http.StatusTooEarly)
		return true
	}
	j := openJournalT(t, filepath.Join(t.TempDir(), "j"))
	res, err := newClientT(t, testConfig(t, f, j)).Submit(t.Context(), payment)
	if err != nil {
		t.Fatalf("Submit: %v", err)
	}
	if res.Status != IntentDone || res.HTTPStatus != http.StatusAccepted || res.Attempts != 2 {
		t.Fatalf("result = %+v, want done (202) after 2 attempts: 425 is not final", res)
	}
	if seen, executed := f.snapshot(); len(distinct(seen)) != 1 || len(executed) != 1 {
		t.Fatalf("keys %q, executions %d; want one key and one execution", distinct(seen), len(executed))
	}
}

// A response longer than MaxResponseBytes is still the server's answer: the intent is
// done. But the body kept is cut at MaxResponseBytes (the journal record stays
// bounded), and Result.Truncated says so; a body of exactly MaxResponseBytes is whole.
func TestClientResponseTruncated(t *testing.T) {
	body := []byte(`{"id":"pay_1","receipt":"` + strings.Repeat("r", 100) + `"}`)
	for _, tc := range []struct {
		name      string
		max       int64
		truncated bool
	}{
		{"longer than the limit", 16, true},
		{"exactly the limit", int64(len(body)), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeIngress(t)
			f.fail = func(_ int, w http.ResponseWriter, _ *http.Request, _ []byte) bool {
				w.WriteHeader(http.StatusAccepted)
				_, _ = w.Write(body)
				return true
			}
			j := openJournalT(t, filepath.Join(t.TempDir(), "j"))
			cfg := testConfig(t, f, j)
			cfg.MaxResponseBytes = tc.max
			res, err := newClientT(t, cfg).Submit(t.Context(), payment)
			if err != nil {
				t.Fatalf("Submit: %v", err)
			}
			if res.Status != IntentDone || res.HTTPStatus != http.StatusAccepted || res.Attempts != 1 {
				t.Fatalf("result = %+v, want done (202) after 1 attempt", res)
			}
			if res.Truncated != tc.truncated {
				t.Fatalf("Result.Truncated = %v, want %v (body %d bytes, limit %d)", res.Truncated, tc.truncated, len(body), tc.max)
			}
			in, _ := j.Get(res.Key)
			if want := body[:tc.max]; !bytes.Equal(in.Response, want) {
				t.Fatalf("journal keeps %d bytes %q, want the first %d", len(in.Response), in.Response, tc.max)
			}
			if !json.Valid(res.Response) {
				t.Fatalf("Result.Response %q is not JSON", res.Response)
			}
		})
	}
}
