// Package deps checks what an embedder's module graph gets from idem.
package deps

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// What the reference app, the benchmarks, the browser tests and the Watermill
// adapter need, and an embedder of the core packages must not get.
var forbidden = []string{
	"github.com/chromedp/",
	"github.com/wneessen/go-mail",
	"github.com/nats-io/nats-server",
	"github.com/ThreeDotsLabs/watermill",
}

// A probe module that imports every public core package, as an embedder's would
// (the test kit too), has none of the forbidden modules in `go mod graph`.
func TestEmbedderModuleGraph(t *testing.T) {
	_, here, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(here), "..", "..")
	dir := t.TempDir()
	write := func(name, text string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("go.mod", "module probe\n\ngo 1.26.0\n\nrequire github.com/idemkit/idem v0.0.0\n\nreplace github.com/idemkit/idem => "+root+"\n")
	write("main.go", `package main

import (
	_ "github.com/idemkit/idem"
	_ "github.com/idemkit/idem/client"
	_ "github.com/idemkit/idem/consumer"
	_ "github.com/idemkit/idem/deadletter"
	_ "github.com/idemkit/idem/dedupe"
	_ "github.com/idemkit/idem/idemtest"
	_ "github.com/idemkit/idem/install"
	_ "github.com/idemkit/idem/migrations"
	_ "github.com/idemkit/idem/outbox"
	_ "github.com/idemkit/idem/producer"
	_ "github.com/idemkit/idem/worker"
)

func main() {}
`)
	run := func(args ...string) string {
		cmd := exec.CommandContext(t.Context(), "go", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	run("mod", "tidy")
	graph := run("mod", "graph")
	for _, line := range strings.Split(graph, "\n") {
		for _, f := range forbidden {
			if strings.Contains(line, f) {
				t.Errorf("the embedder's module graph holds %s: %s", f, line)
			}
		}
	}
	if !strings.Contains(graph, "github.com/jackc/pgx/v5") || !strings.Contains(graph, "github.com/nats-io/nats.go") {
		t.Errorf("the graph lacks pgx or nats.go, so it is not idem's:\n%s", graph)
	}
	t.Logf("the probe's graph has %d edges", strings.Count(graph, "\n"))
}

// The modules a user requires beside the library import none of the library's
// internal/ packages, in their code or their tests: Go allows it across module
// lines (the rule is on import paths), but the library promises nothing there, so
// a release of the library could break a released sibling.
func TestUserModulesImportNoInternal(t *testing.T) {
	_, here, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(here), "..", "..")
	const internal = "github.com/idemkit/idem/internal/"
	for _, dir := range []string{"watermill", "embeddednats", "clients/browser"} {
		cmd := exec.CommandContext(t.Context(), "go", "list", "-test", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, "./...")
		cmd.Dir = filepath.Join(root, dir)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("go list in %s: %v\n%s", dir, err, out)
		}
		pkgs := 0
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			fields := strings.Fields(line)
			if len(fields) == 0 {
				continue
			}
			pkgs++
			for _, imp := range fields[1:] {
				if strings.HasPrefix(imp, internal) {
					t.Errorf("%s: %s imports %s", dir, fields[0], imp)
				}
			}
		}
		if pkgs == 0 {
			t.Errorf("go list in %s listed no package", dir)
		}
	}
}

// The library's plumbing (internal/, the test kit aside) imports no public package
// but the vocabulary, the root package and wire (the message format's, which
// imports nothing of idem's but the root): the public packages stand on the
// plumbing, never the other way round, and the internal services take what they share with the public
// ones as an internal value (internal/parts) instead of an *install.Installation.
// The root package, the floor everything stands on, imports nothing of idem's.
func TestPlumbingImportsNoPublicPackage(t *testing.T) {
	_, here, _, _ := runtime.Caller(0)
	const lib = "github.com/idemkit/idem"
	vocabulary := map[string]bool{lib + "/wire": true}
	cmd := exec.CommandContext(t.Context(), "go", "list", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, ".", "./internal/...", "./wire")
	cmd.Dir = filepath.Join(filepath.Dir(here), "..", "..")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	pkgs := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 || strings.HasPrefix(fields[0], lib+"/internal/testkit/") {
			continue
		}
		pkgs++
		for _, imp := range fields[1:] {
			if fields[0] == lib && strings.HasPrefix(imp, lib+"/") {
				t.Errorf("the root package imports %s: it may import nothing of idem's", imp)
				continue
			}
			if vocabulary[fields[0]] && strings.HasPrefix(imp, lib+"/") {
				t.Errorf("the vocabulary package %s imports %s: it may import the root package only", fields[0], imp)
				continue
			}
			if strings.HasPrefix(imp, lib+"/") && !strings.HasPrefix(imp, lib+"/internal/") && !vocabulary[imp] {
				t.Errorf("%s imports the public package %s", fields[0], imp)
			}
		}
	}
	if pkgs < 5 {
		t.Errorf("go list ./internal/... listed %d packages of the plumbing: not the library's", pkgs)
	}
}
