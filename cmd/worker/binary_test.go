package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
)

// The worker binary, built once for the tests that run it as a process.
var built struct {
	once sync.Once
	dir  string
	bin  string
	err  error
	out  []byte
}

// workerBinary builds this command once per test run and returns its path.
func workerBinary(t *testing.T) string {
	t.Helper()
	built.once.Do(func() {
		if built.dir, built.err = os.MkdirTemp("", "idem-worker-test-"); built.err != nil {
			return
		}
		built.bin = filepath.Join(built.dir, "worker")
		built.out, built.err = exec.Command("go", "build", "-o", built.bin, ".").CombinedOutput()
	})
	if built.err != nil {
		t.Fatalf("go build: %v\n%s", built.err, built.out)
	}
	return built.bin
}

func TestMain(m *testing.M) {
	code := m.Run()
	if built.dir != "" {
		_ = os.RemoveAll(built.dir)
	}
	os.Exit(code)
}
