package producer

import (
	"bytes"
	"testing"
)

// The request fingerprint is unambiguous across field boundaries (method, path and
// body are length-prefixed), deterministic, and a SHA-256. The end-to-end
// consequence — same key, other request, 422 — is TestMiddlewareFingerprintIsUnambiguous.
func TestFingerprint(t *testing.T) {
	t.Parallel()
	a := fingerprint("POST", "/ab", []byte("c"))
	b := fingerprint("POST", "/a", []byte("bc"))
	c := fingerprint("POS", "T/ab", []byte("c"))
	if bytes.Equal(a, b) || bytes.Equal(a, c) {
		t.Error("fingerprint is ambiguous across field boundaries")
	}
	if !bytes.Equal(a, fingerprint("POST", "/ab", []byte("c"))) {
		t.Error("fingerprint is not deterministic")
	}
	if len(a) != 32 {
		t.Errorf("fingerprint is %d bytes, want 32 (SHA-256)", len(a))
	}
}
