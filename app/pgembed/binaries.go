package pgembed

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// binaries is one PostgreSQL installation's server programs.
type binaries struct {
	dir     string // holds initdb, pg_ctl and postgres
	version string // full version, "15.20"
	major   string // "15"; "9.6" before PostgreSQL 10
}

func (b binaries) initdb() string { return filepath.Join(b.dir, "initdb") }
func (b binaries) pgCtl() string  { return filepath.Join(b.dir, "pg_ctl") }

// installGlobs are where PostgreSQL packages put their server programs. Most
// distributions keep initdb and pg_ctl off PATH (Debian's postgresql package only
// links the client programs), so PATH alone would miss them.
func installGlobs() []string {
	return []string{
		"/usr/lib/postgresql/*/bin",          // Debian, Ubuntu
		"/usr/pgsql-*/bin",                   // RHEL, Fedora, Rocky (PGDG packages)
		"/usr/local/pgsql/bin",               // built from source
		"/opt/homebrew/opt/postgresql@*/bin", // Homebrew, Apple silicon
		"/usr/local/opt/postgresql@*/bin",    // Homebrew, Intel
		"/Applications/Postgres.app/Contents/Versions/*/bin",
	}
}

// findBinaries picks the PostgreSQL installation to use: binDir when set, otherwise
// the newest installation found under installGlobs or on PATH. When wantMajor is
// set (an existing cluster's version) only that major version will do.
func findBinaries(ctx context.Context, binDir, wantMajor string) (binaries, error) {
	var dirs []string
	if binDir != "" {
		dirs = []string{binDir}
	} else {
		dirs = searchDirs(installGlobs())
	}
	var found []binaries
	for _, d := range dirs {
		b, err := probe(ctx, d)
		if err != nil {
			continue
		}
		found = append(found, b)
	}
	if len(found) == 0 {
		where := "under " + strings.Join(installGlobs(), ", ") + " or on PATH"
		if binDir != "" {
			where = "in " + binDir
		}
		return binaries{}, fmt.Errorf("%w %s. Install PostgreSQL (e.g. apt install postgresql), "+
			"or run `docker compose up` (docker-compose.yml in the repository root), "+
			"or set DATABASE_URL to a Postgres server you already have", ErrNoBinaries, where)
	}
	sort.SliceStable(found, func(i, j int) bool { return versionLess(found[j].version, found[i].version) })
	if wantMajor == "" {
		return found[0], nil
	}
	var have []string
	for _, b := range found {
		if b.major == wantMajor {
			return b, nil
		}
		have = append(have, b.major)
	}
	return binaries{}, fmt.Errorf("pgembed: the existing cluster was created by PostgreSQL %s, but only version(s) %s are installed: "+
		"install PostgreSQL %s, or move the cluster directory away to start an empty one", wantMajor, strings.Join(have, ", "), wantMajor)
}

// searchDirs expands globs, then adds the directory of pg_ctl on PATH, each
// directory once (a PATH entry is often a symlink into one of the globs).
func searchDirs(globs []string) []string {
	var dirs []string
	seen := map[string]bool{}
	add := func(d string) {
		if real, err := filepath.EvalSymlinks(d); err == nil {
			d = real
		}
		if !seen[d] {
			seen[d] = true
			dirs = append(dirs, d)
		}
	}
	for _, g := range globs {
		matches, _ := filepath.Glob(g)
		for _, m := range matches {
			add(m)
		}
	}
	if p, err := exec.LookPath("pg_ctl"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		add(filepath.Dir(p))
	}
	return dirs
}

var versionRE = regexp.MustCompile(`\(PostgreSQL\) (\d+(?:\.\d+)*)`)

// probe checks that dir holds the server programs and asks pg_ctl its version.
// (`pg_ctl --version` is one of the few things pg_ctl agrees to do as root.)
func probe(ctx context.Context, dir string) (binaries, error) {
	for _, prog := range []string{"initdb", "pg_ctl", "postgres"} {
		fi, err := os.Stat(filepath.Join(dir, prog))
		if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
			return binaries{}, fmt.Errorf("pgembed: %s: no executable %s", dir, prog)
		}
	}
	out, err := exec.CommandContext(ctx, filepath.Join(dir, "pg_ctl"), "--version").Output()
	if err != nil {
		return binaries{}, fmt.Errorf("pgembed: %s/pg_ctl --version: %w", dir, err)
	}
	m := versionRE.FindSubmatch(out)
	if m == nil {
		return binaries{}, fmt.Errorf("pgembed: %s/pg_ctl --version: unexpected output %q", dir, out)
	}
	v := string(m[1])
	return binaries{dir: dir, version: v, major: majorOf(v)}, nil
}

// majorOf returns the major version as PG_VERSION spells it: the first number
// since PostgreSQL 10 ("15.20" -> "15"), the first two before ("9.6.24" -> "9.6").
func majorOf(v string) string {
	parts := strings.Split(v, ".")
	if n, _ := strconv.Atoi(parts[0]); n < 10 && len(parts) > 1 {
		return parts[0] + "." + parts[1]
	}
	return parts[0]
}

// versionLess compares dotted versions numerically ("9.6" < "15.2" < "15.10").
func versionLess(a, b string) bool {
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(as) && i < len(bs); i++ {
		x, _ := strconv.Atoi(as[i])
		y, _ := strconv.Atoi(bs[i])
		if x != y {
			return x < y
		}
	}
	return len(as) < len(bs)
}
