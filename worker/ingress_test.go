package worker_test

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/worker"
)

// A worker built without Config.Ingress has a nil Ingress (a service that splits
// roles checks for it), and a route wrapped by it anyway answers 500 saying which
// field is missing, instead of dropping the connection on a nil dereference; the
// handler never runs unguarded, and the mistake is logged once, where the route is
// wrapped. Not parallel: the message goes to slog's default logger, swapped here.
func TestIngressLeftOutSaysSo(t *testing.T) {
	env := testenv.New(t)
	cfg := ordersConfig()
	cfg.Ingress = nil
	w, err := worker.New(newInst(t, env.DB.Pool, env.NC, ordersInstall("")), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if w.Ingress() != nil {
		t.Fatal("Ingress() without Config.Ingress is not nil; a service can no longer tell")
	}
	var logs bytes.Buffer
	prev := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&logs, nil)))
	var ran atomic.Int32
	h := w.Ingress().Wrap(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		ran.Add(1)
		rw.WriteHeader(http.StatusAccepted)
	}))
	slog.SetDefault(prev)
	srv := httptest.NewServer(h)
	defer srv.Close()

	for _, method := range []string{http.MethodPost, http.MethodPost, http.MethodGet} {
		req, _ := http.NewRequest(method, srv.URL+"/orders", strings.NewReader("teapot"))
		req.Header.Set(idem.HeaderKey, string(idem.NewKey()))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s through a nil Ingress: %v", method, err)
		}
		var body struct{ Error, Code string }
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusInternalServerError || body.Code != "ingress_not_configured" ||
			!strings.Contains(body.Error, "worker.Config.Ingress") {
			t.Errorf("%s through a nil Ingress = %d %+v (%v), want 500 ingress_not_configured naming worker.Config.Ingress",
				method, resp.StatusCode, body, err)
		}
	}
	if n := ran.Load(); n != 0 {
		t.Errorf("the handler ran %d times behind a nil Ingress", n)
	}
	if n := strings.Count(logs.String(), "worker.Config.Ingress is left out"); n != 1 {
		t.Errorf("logged %d times, want once:\n%s", n, logs.String())
	}
}
