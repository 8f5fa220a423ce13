package idem_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/idemkit/idem"
)

func TestParseKey(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want error
	}{
		{"01936b2e-1c2f-7a3b-8000-000000000000", nil},
		{"k", nil},
		{"a key with spaces inside", nil},
		{strings.Repeat("x", idem.MaxKeyLen), nil},
		{"", idem.ErrMissingKey},
		{"   ", idem.ErrMalformedKey},
		{strings.Repeat("x", idem.MaxKeyLen+1), idem.ErrMalformedKey},
		{"tab\tkey", idem.ErrMalformedKey},
		{"k\x1fk", idem.ErrMalformedKey},
		{"clé", idem.ErrMalformedKey},
		{"k ", idem.ErrMalformedKey}, // a transport that trims would fold it into "k"
		{" k", idem.ErrMalformedKey},
	} {
		k, err := idem.ParseKey(tc.in)
		switch {
		case tc.want == nil && err != nil:
			t.Errorf("ParseKey(%q) = %v, want ok", tc.in, err)
		case tc.want == nil && string(k) != tc.in:
			t.Errorf("ParseKey(%q) = %q", tc.in, k)
		case tc.want != nil && !errors.Is(err, tc.want):
			t.Errorf("ParseKey(%q) error = %v, want %v", tc.in, err, tc.want)
		}
	}
}

func TestNewKeyIsValidAndFresh(t *testing.T) {
	t.Parallel()
	seen := map[idem.Key]bool{}
	for range 1000 {
		k := idem.NewKey()
		if _, err := idem.ParseKey(string(k)); err != nil {
			t.Fatalf("NewKey() = %q is not a valid key: %v", k, err)
		}
		if seen[k] {
			t.Fatalf("NewKey() repeated %q", k)
		}
		seen[k] = true
	}
}

func TestScopedKeyRoundTripAndIsolation(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		scope string
		key   idem.Key
	}{{"", "k"}, {"tenant-a", "k"}, {"tenant b", "01936b2e"}, {"t", "k with spaces"}} {
		s := idem.ScopedKey(tc.scope, tc.key)
		scope, key, err := idem.ParseScopedKey(s)
		if err != nil || scope != tc.scope || key != tc.key {
			t.Errorf("ParseScopedKey(ScopedKey(%q, %q)) = %q, %q, %v", tc.scope, tc.key, scope, key, err)
		}
	}
	if idem.ScopedKey("a", "k") == idem.ScopedKey("b", "k") || idem.ScopedKey("a", "k") == "k" {
		t.Fatal("two scopes, or a scope and no scope, share a scoped key")
	}
}

func TestParseScopedKeyRejects(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want error
	}{
		{"", idem.ErrMissingKey},
		{"\x1fk", idem.ErrMalformedKey},      // empty scope before the separator
		{"tenant\x1f", idem.ErrMalformedKey}, // empty key after it
		{"a\x1fb\x1fc", idem.ErrMalformedKey},
		{"t\x1f\x00", idem.ErrMalformedKey},
		{strings.Repeat("s", idem.MaxKeyLen+1) + "\x1fk", idem.ErrMalformedKey},
	} {
		if _, _, err := idem.ParseScopedKey(tc.in); !errors.Is(err, tc.want) {
			t.Errorf("ParseScopedKey(%q) error = %v, want %v", tc.in, err, tc.want)
		}
	}
}

// Every valid (scope, key) pair survives the join, and nothing ParseScopedKey
// accepts fails to re-join into the same bytes: the wire identity is a bijection.
func FuzzScopedKey(f *testing.F) {
	f.Add("", "k")
	f.Add("tenant", "01936b2e-1c2f-7a3b-8000-000000000000")
	f.Add("t\x1fx", "k")
	f.Fuzz(func(t *testing.T, scope, key string) {
		if idem.ValidateScope(scope) != nil {
			return
		}
		if _, err := idem.ParseKey(key); err != nil {
			return
		}
		s := idem.ScopedKey(scope, idem.Key(key))
		gotScope, gotKey, err := idem.ParseScopedKey(s)
		if err != nil || gotScope != scope || string(gotKey) != key {
			t.Fatalf("round trip of (%q, %q) via %q = (%q, %q, %v)", scope, key, s, gotScope, gotKey, err)
		}
		if gotScope, gotKey, err := idem.ParseScopedKey(scope + key); err == nil && idem.ScopedKey(gotScope, gotKey) != scope+key {
			t.Fatalf("ParseScopedKey(%q) accepted a form ScopedKey does not produce", scope+key)
		}
	})
}

func TestMsgIDSeparatesSubjectsAndScopes(t *testing.T) {
	t.Parallel()
	ids := map[string]bool{}
	for _, subject := range []string{"orders.created", "orders.created.eu", "mail.send"} {
		for _, scoped := range []string{"k", idem.ScopedKey("t1", "k"), idem.ScopedKey("t2", "k")} {
			id := idem.MsgID(subject, scoped)
			if ids[id] {
				t.Fatalf("MsgID(%q, %q) = %q collides", subject, scoped, id)
			}
			ids[id] = true
		}
	}
}

func TestValidateSubjectAndFilter(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		s          string
		literal, _ bool
	}{
		{"orders.created", true, true},
		{"idem.payments.charge", true, true},
		{"a", true, true},
		{"orders.>", false, true},
		{"orders.*.eu", false, true},
		{">", false, true},
		{"orders.>.x", false, false},
		{"", false, false},
		{"orders.", false, false},
		{".orders", false, false},
		{"orders..created", false, false},
		{"orders created", false, false},
		{"orders.cre*ted", false, false},
		{"orders.\tx", false, false},
		{"orders.é", false, false},
	} {
		if err := idem.ValidateSubject(tc.s); (err == nil) != tc.literal || (err != nil && !errors.Is(err, idem.ErrBadSubject)) {
			t.Errorf("ValidateSubject(%q) = %v, want ok=%v", tc.s, err, tc.literal)
		}
	}
}

// The Msg-Id of a named message differs from the unnamed one's and from every
// other name's.
func TestMessageIdentity(t *testing.T) {
	unnamed := idem.Message{Key: "k", Subject: "orders.line"}
	one, two := unnamed, unnamed
	one.Name, two.Name = "line-1", "line-2"
	ids := map[string]bool{unnamed.MsgID(): true, one.MsgID(): true, two.MsgID(): true}
	if len(ids) != 3 || unnamed.MsgID() != idem.MsgID("orders.line", "k") {
		t.Errorf("Msg-Ids %q, %q, %q: want three, the unnamed one unchanged", unnamed.MsgID(), one.MsgID(), two.MsgID())
	}
	for _, bad := range []string{"a b", "a\x1eb", strings.Repeat("x", 129)} {
		if idem.ValidateMessageName(bad) == nil {
			t.Errorf("ValidateMessageName(%q) accepted", bad)
		}
	}
}
