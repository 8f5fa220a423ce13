package main

import (
	"os/exec"
	"strings"
	"testing"
)

// The client CLI links no database driver: the client side of idem is package
// client, and nothing of the server side (producer, outbox) may reach it through
// an import.
func TestNoDatabaseDriver(t *testing.T) {
	out, err := exec.CommandContext(t.Context(), "go", "list", "-deps", "github.com/idemkit/idem/cmd/enqueue").Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("go list -deps: %v\n%s", err, stderr)
	}
	for _, dep := range strings.Split(string(out), "\n") {
		if strings.Contains(dep, "jackc/pgx") {
			t.Errorf("cmd/enqueue depends on %s", dep)
		}
	}
}
