package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/testkit/pgtest"
)

// `worker installation show` prints the database's token and epoch; `worker
// installation adopt TOKEN --epoch N` sets the token, and an epoch of at least N.
func TestInstallationShowAndAdopt(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	flags := []string{"--database-url", db.URL}
	show := func() (token string, epoch int64) {
		t.Helper()
		out, errs, code := worker(t, append([]string{"installation", "show", "--json"}, flags...)...)
		if code != exitOK {
			t.Fatalf("installation show: exit %d: %s", code, errs)
		}
		var got struct {
			Token string `json:"token"`
			Epoch int64  `json:"epoch"`
		}
		if err := json.Unmarshal([]byte(out), &got); err != nil {
			t.Fatalf("installation show --json: %q: %v", out, err)
		}
		return got.Token, got.Epoch
	}
	token, epoch := show()
	if len(token) != 36 || epoch != 0 {
		t.Fatalf("a new installation: token %q epoch %d, want a UUID and 0", token, epoch)
	}
	const theirs = "0b6c3d1e-6f0a-4c1e-9a59-3c0f1e2d4b5a"
	out, errs, code := worker(t, append([]string{"installation", "adopt", theirs, "--epoch", "7"}, flags...)...)
	if code != exitOK || !strings.Contains(out, "token "+theirs) || !strings.Contains(out, "epoch 7") {
		t.Fatalf("installation adopt: exit %d, out %q, err %q", code, out, errs)
	}
	if tok, ep := show(); tok != theirs || ep != 7 {
		t.Errorf("after adopt: token %s epoch %d, want %s 7", tok, ep, theirs)
	}
	// An epoch is never moved back: a lower --epoch keeps it.
	if _, errs, code := worker(t, append([]string{"installation", "adopt", theirs, "--epoch", "3"}, flags...)...); code != exitOK {
		t.Fatalf("installation adopt --epoch 3: exit %d: %s", code, errs)
	}
	if _, ep := show(); ep != 7 {
		t.Errorf("after adopt --epoch 3: epoch %d, want 7 kept", ep)
	}
	for _, args := range [][]string{{"installation", "adopt"}, {"installation", "adopt", "not-a-token"}, {"installation", "adopt", theirs, "--epoch", "-1"}} {
		if _, _, code := worker(t, append(args, flags...)...); code != exitUsage {
			t.Errorf("worker %s: exit %d, want %d", strings.Join(args, " "), code, exitUsage)
		}
	}
}
