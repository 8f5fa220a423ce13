package chaos

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/natstest"
)

// The binaries under test, built once per test run by TestMain. These are the
// package's only globals.
var (
	workerBin   string // go build ./cmd/worker
	enqueueBin  string // go build ./cmd/enqueue
	natsBin     string // the test kit's nats-server (internal/testkit/natstest.Binary)
	idworkerBin string // go build ./test/chaos/idworker (the identity cases' worker)
	buildErr    error  // why the binaries could not be built; every test reports it
)

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		os.Exit(m.Run()) // every test skips; do not spend time building
	}
	dir, err := os.MkdirTemp("", "idem-chaos-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos: temp dir for binaries:", err)
		os.Exit(1)
	}
	buildErr = buildBinaries(dir)
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// buildBinaries builds the worker, the client and idworker into dir, beside the
// test kit's nats-server (built from source at the version it pins, never
// downloaded as a binary).
func buildBinaries(dir string) error {
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		return fmt.Errorf("chaos: repository root not found at %s: %w", root, err)
	}
	start := time.Now()
	build := func(pkgs ...string) error {
		// The worker is built with its fault points armable (IDEM_FAULTS); the
		// shipped binary refuses them.
		args := append([]string{"build", "-tags", "idemfaults", "-o", dir + string(filepath.Separator)}, pkgs...)
		cmd := exec.Command("go", args...)
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("chaos: go %s: %w\n%s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	errs := make(chan error, 2)
	go func() { errs <- build("./cmd/worker", "./cmd/enqueue", "./test/chaos/idworker") }()
	go func() {
		var err error
		natsBin, err = natstest.Binary() // the test kit's, at the version it pins
		errs <- err
	}()
	if err := errors.Join(<-errs, <-errs); err != nil {
		return err
	}
	workerBin = filepath.Join(dir, "worker")
	enqueueBin = filepath.Join(dir, "enqueue")
	idworkerBin = filepath.Join(dir, "idworker")
	fmt.Fprintf(os.Stderr, "chaos: built worker, enqueue, idworker and nats-server in %s\n", time.Since(start).Round(100*time.Millisecond))
	return nil
}
