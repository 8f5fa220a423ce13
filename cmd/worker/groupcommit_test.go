package main

import "testing"

// --group-commit (IDEM_GROUP_COMMIT): empty or 0 is off; 1..32 is the group size;
// anything else is a usage error.
func TestParseGroupCommit(t *testing.T) {
	for v, want := range map[string]int{"": 0, "0": 0, "1": 1, "8": 8, "32": 32} {
		if got, err := parseGroupCommit(v); err != nil || got != want {
			t.Errorf("parseGroupCommit(%q) = %d, %v; want %d", v, got, err, want)
		}
	}
	for _, v := range []string{"33", "-1", "x", "8ms"} {
		if _, err := parseGroupCommit(v); err == nil {
			t.Errorf("parseGroupCommit(%q) accepted", v)
		}
	}
}
