// Package release checks that the repository's modules resolve for a stranger: from
// a module proxy, at a tagged version, with no replace and no go.work.
package release

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
)

const root = "github.com/idemkit/idem"

// release is a version a release tag carries (docs/RELEASING.md): no pre-release,
// no pseudo-version.
var release = regexp.MustCompile(`^v[0-9]+\.[0-9]+\.[0-9]+$`)

// The modules a user requires; the proof imports each (the library with its test
// kit idemtest, the Watermill adapter, and the in-process JetStream server that
// idemtest's cases run on).
var userModules = []string{root, root + "/watermill", root + "/embeddednats"}

// modFile is the part of `go mod edit -json` the proof reads.
type modFile struct {
	Module  struct{ Path string }
	Require []struct {
		Path     string
		Version  string
		Indirect bool
	}
	Replace []struct{ Old struct{ Path string } }
}

// A fresh module outside the repository requires the library (idemtest is one of
// its packages), the Watermill adapter and embeddednats at the version the repository's modules require of each other,
// resolves them from a module proxy on disk built from a clone tagged at that
// version (GOWORK=off, GOFLAGS=-mod=mod, no replace anywhere), and runs one
// idemtest case. The tags exist only in the temporary clone; the clone is of the
// checkout's last commit.
func TestModulesResolveFromAProxyWithoutReplace(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a module proxy and a fresh module")
	}
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("git not found")
	}
	_, here, _, _ := runtime.Caller(0)
	repo := filepath.Join(filepath.Dir(here), "..", "..")
	if r := os.Getenv("IDEM_RELEASE_REPO"); r != "" {
		repo = r // another checkout to prove, e.g. a branch's worktree
	}
	tmp := t.TempDir()

	clone := filepath.Join(tmp, "repo")
	run(t, "", nil, "git", "clone", "-q", "--no-hardlinks", repo, clone)

	// Every module's go.mod, by its directory in the clone.
	mods := map[string]modFile{}
	err := filepath.WalkDir(clone, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.Name() != "go.mod" {
			return nil
		}
		var m modFile
		out := run(t, filepath.Dir(p), nil, "go", "mod", "edit", "-json")
		if err := json.Unmarshal([]byte(out), &m); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		rel, _ := filepath.Rel(clone, filepath.Dir(p))
		mods[filepath.ToSlash(rel)] = m
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	// The version is the one the modules require of each other: a release, the same
	// everywhere, and no replace to stand in for it.
	version := ""
	for dir, m := range mods {
		for _, r := range m.Replace {
			t.Errorf("%s/go.mod replaces %s: a dependency's replace is not applied, so a user would not get it", dir, r.Old.Path)
		}
		for _, r := range m.Require {
			if r.Path != root && !strings.HasPrefix(r.Path, root+"/") {
				continue
			}
			if !release.MatchString(r.Version) {
				t.Errorf("%s/go.mod requires %s at %s, which no release tag can be", dir, r.Path, r.Version)
				continue
			}
			if version == "" {
				version = r.Version
			} else if r.Version != version {
				t.Errorf("%s/go.mod requires %s at %s, others at %s", dir, r.Path, r.Version, version)
			}
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	if version == "" {
		t.Fatal("no module requires another of the repository's: nothing pins a version")
	}

	// Tag the clone as a release would: the library at the version, each nested
	// module at dir/version.
	git := func(args ...string) {
		run(t, clone, nil, "git", append([]string{"-c", "user.name=release", "-c", "user.email=release@test"}, args...)...)
	}
	for dir := range mods {
		tag := version
		if dir != "." {
			tag = dir + "/" + version
		}
		git("tag", tag)
	}

	// The proxy: the go command fetches the tagged modules from the clone over git
	// (private, direct) into a module cache whose download directory is then served
	// as a file:// GOPROXY.
	gitconfig := filepath.Join(tmp, "gitconfig")
	if err := os.WriteFile(gitconfig, []byte(fmt.Sprintf("[url %q]\n\tinsteadOf = https://%s\n[protocol \"file\"]\n\tallow = always\n", "file://"+clone, root)), 0o644); err != nil {
		t.Fatal(err)
	}
	proxyCache := filepath.Join(tmp, "proxy")
	fetch := []string{"GOWORK=off", "GOFLAGS=-modcacherw", "GOPROXY=direct", "GOPRIVATE=" + root, "GONOSUMDB=" + root,
		"GOMODCACHE=" + proxyCache, "GIT_CONFIG_GLOBAL=" + gitconfig, "GIT_CONFIG_NOSYSTEM=1"}
	want := []string{"mod", "download"}
	for dir := range mods {
		path := mods[dir].Module.Path
		if slices.Contains(userModules, path) || dependsOn(mods, userModules, path) {
			want = append(want, path+"@"+version)
		}
	}
	run(t, tmp, fetch, "go", want...)

	// The fresh module, outside the repository.
	user := filepath.Join(tmp, "user")
	if err := os.Mkdir(user, 0o755); err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(user, "go.mod"), "module example.com/user\n\ngo 1.26.0\n\nrequire (\n"+
		"\t"+root+" "+version+"\n\t"+root+"/watermill "+version+"\n\t"+root+"/embeddednats "+version+"\n)\n")
	write(t, filepath.Join(user, "user_test.go"), userTest)
	realCache := strings.TrimSpace(run(t, tmp, nil, "go", "env", "GOMODCACHE"))
	env := []string{"GOWORK=off", "GOFLAGS=-mod=mod -modcacherw -trimpath",
		"GOPROXY=file://" + filepath.ToSlash(filepath.Join(proxyCache, "cache", "download")) +
			",file://" + filepath.ToSlash(filepath.Join(realCache, "cache", "download")) + ",https://proxy.golang.org",
		"GOPRIVATE=", "GONOSUMDB=" + root, "GONOPROXY=",
		// Third-party modules come from this machine's cache, checked when it was
		// filled; the checksum database is not asked again.
		"GOSUMDB=off",
		"GOMODCACHE=" + filepath.Join(tmp, "usercache")}
	run(t, user, env, "go", "mod", "tidy")
	out := run(t, user, env, "go", "test", "-count=1", "-run", "TestOnce", "-v", ".")
	if !strings.Contains(out, "--- PASS: TestOnce") {
		t.Fatalf("the idemtest case did not pass:\n%s", out)
	}
	graph := run(t, user, env, "go", "list", "-m", "all")
	for _, m := range userModules {
		if !strings.Contains(graph, m+" "+version) {
			t.Errorf("the fresh module resolved no %s %s:\n%s", m, version, graph)
		}
	}
}

// dependsOn reports whether one of the user modules requires path (a sibling the
// proxy must hold too).
func dependsOn(mods map[string]modFile, users []string, path string) bool {
	for _, m := range mods {
		if !slices.Contains(users, m.Module.Path) {
			continue
		}
		for _, r := range m.Require {
			if r.Path == path {
				return true
			}
		}
	}
	return false
}

func write(t *testing.T, name, text string) {
	t.Helper()
	if err := os.WriteFile(name, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

// run runs a command in dir with env added to the process's, and fails t with its
// output if it fails.
func run(t *testing.T, dir string, env []string, name string, args ...string) string {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s (in %s): %v\n%s", name, strings.Join(args, " "), dir, err, out.String())
	}
	return out.String()
}

// userTest is the stranger's test: one idemtest case of an in-transaction handler,
// on a JetStream server embeddednats runs in the test, with the Watermill adapter
// linked in.
const userTest = `package user

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/embeddednats"
	"github.com/idemkit/idem/idemtest"
	idemwatermill "github.com/idemkit/idem/watermill"
)

var _ = idemwatermill.Middleware

func TestOnce(t *testing.T) {
	srv, err := embeddednats.Start(embeddednats.Config{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	env := idemtest.New(t, idemtest.Config{
		NATSURL: srv.URL(),
		Migrate: func(ctx context.Context, pool *pgxpool.Pool) error {
			_, err := pool.Exec(ctx, "CREATE TABLE shipments (key text NOT NULL)")
			return err
		},
	})
	ship := consumer.HandlerFunc(func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) ([]byte, error) {
		_, err := tx.Exec(ctx, "INSERT INTO shipments (key) VALUES ($1)", d.Key)
		return nil, err
	})
	report, err := idemtest.Check(t.Context(), env, idemtest.Case{
		Consumer: consumer.Config{Name: "shipping", Subject: "orders.paid", Handler: ship},
		Message:  idem.Message{Subject: "orders.paid", Payload: []byte("{}")},
		Effects: func(ctx context.Context, pool *pgxpool.Pool, key string) (n int, err error) {
			err = pool.QueryRow(ctx, "SELECT count(*) FROM shipments WHERE key = $1", key).Scan(&n)
			return n, err
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !report.OK() {
		t.Fatal(report)
	}
}
`
