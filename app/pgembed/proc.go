package pgembed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// runner runs PostgreSQL's programs for one cluster directory, as the right user.
type runner struct {
	cfg  Config
	bins binaries
	// as is the identity the programs run as when this process is root (initdb,
	// pg_ctl and postgres all refuse to run as root); nil otherwise.
	as *syscall.Credential
}

func newRunner(cfg Config) (*runner, error) {
	r := &runner{cfg: cfg}
	if os.Geteuid() != 0 {
		return r, nil
	}
	u, err := user.Lookup(cfg.SystemUser)
	if err != nil {
		return nil, fmt.Errorf("pgembed: this process runs as root and PostgreSQL refuses to run as root, "+
			"so it must run as the %q system user, but there is none (%v): create it (useradd --system %s), "+
			"run the worker as a non-root user, or set DATABASE_URL", cfg.SystemUser, err, cfg.SystemUser)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return nil, fmt.Errorf("pgembed: user %s: %w", cfg.SystemUser, err)
	}
	cred := &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}
	if ids, err := u.GroupIds(); err == nil {
		for _, id := range ids {
			if g, err := strconv.ParseUint(id, 10, 32); err == nil {
				cred.Groups = append(cred.Groups, uint32(g))
			}
		}
	}
	r.as = cred
	cfg.Logger.Debug("running as root: Postgres runs as another user", "user", cfg.SystemUser, "uid", uid)
	return r, nil
}

// prepareDir creates cfg.Dir (mode 0700: it holds the password file) and, under
// root, hands it to the system user after checking that user can reach it at all.
// Dir must be a directory, not a symlink: under root a symlink would hand its
// target to the postgres user.
func (r *runner) prepareDir() error {
	dir := r.cfg.Dir
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return fmt.Errorf("pgembed: %w", err)
	}
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("pgembed: %w", err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("pgembed: %w", err)
	}
	if fi.Mode()&os.ModeSymlink != 0 {
		return fmt.Errorf("pgembed: %s is a symlink; the private cluster's directory must be a plain directory (give its target as the directory instead)", dir)
	}
	if !fi.IsDir() {
		return fmt.Errorf("pgembed: %s is not a directory", dir)
	}
	if r.as == nil {
		return nil
	}
	if err := reachable(filepath.Dir(dir), r.as); err != nil {
		return fmt.Errorf("pgembed: the %q user that runs Postgres cannot reach %s: %w; "+
			"choose a --data-dir that user can reach (e.g. under /var/lib or /tmp), or run as a non-root user",
			r.cfg.SystemUser, dir, err)
	}
	// Lchown: should the name have been swapped for a symlink since the Lstat, the
	// link itself changes owner, not its target.
	if err := os.Lchown(dir, int(r.as.Uid), int(r.as.Gid)); err != nil {
		return fmt.Errorf("pgembed: hand %s to %s: %w", dir, r.cfg.SystemUser, err)
	}
	return nil
}

// checkPgdata refuses, under root, a pgdata that is a symlink: root reads files
// there (PG_VERSION, postmaster.pid), and the postgres user, who owns Dir, could
// point it anywhere. As another user a symlinked pgdata (on another disk, say) is
// that user's own business.
func (r *runner) checkPgdata(pgdata string) error {
	if r.as == nil {
		return nil
	}
	fi, err := os.Lstat(pgdata)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("pgembed: %w", err)
	}
	if fi.Mode()&os.ModeSymlink != 0 {
		return fmt.Errorf("pgembed: %s is a symlink; running as root, pgembed does not follow symlinks inside the postgres user's directory", pgdata)
	}
	return nil
}

// reachable checks that every directory from / down to dir lets cred search it
// (the x bit for owner, group or others, whichever applies). It reads plain mode
// bits; a directory that only an ACL opens is reported unreachable, a clearer
// failure than initdb's.
func reachable(dir string, cred *syscall.Credential) error {
	groups := map[uint32]bool{cred.Gid: true}
	for _, g := range cred.Groups {
		groups[g] = true
	}
	p := dir
	for {
		fi, err := os.Stat(p)
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return nil // not a Unix file system we can reason about; let the programs tell
		}
		mode := fi.Mode().Perm()
		var canSearch bool
		switch {
		case st.Uid == cred.Uid:
			canSearch = mode&0o100 != 0
		case groups[st.Gid]:
			canSearch = mode&0o010 != 0
		default:
			canSearch = mode&0o001 != 0
		}
		if !canSearch {
			return fmt.Errorf("%s is mode %04o, owner uid %d, group gid %d (the user needs search permission: chmod o+x %s)", p, mode, st.Uid, st.Gid, p)
		}
		parent := filepath.Dir(p)
		if parent == p {
			return nil
		}
		p = parent
	}
}

// lockDir takes an exclusive flock on path, so two processes starting the same
// cluster at once do not both run initdb. The lock is released by unlock or when
// the process dies.
func lockDir(path string) (unlock func(), err error) {
	f, err := openPlain(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("pgembed: lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("pgembed: lock %s: %w", path, err)
	}
	return func() {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		f.Close()
	}, nil
}

// command builds one PostgreSQL program invocation: in cfg.Dir, as the system user
// under root, with a predictable environment.
func (r *runner) command(ctx context.Context, prog string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, prog, args...)
	cmd.Dir = r.cfg.Dir // the system user may not be able to enter our working directory
	cmd.Env = childEnv(os.Environ())
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Credential: r.as,
		// Own process group: a Ctrl-C in the terminal goes to the worker, which then
		// stops Postgres cleanly, instead of hitting the server directly.
		Setpgid: true,
	}
	return cmd
}

// childEnv drops PG* variables (PGDATA, PGPORT, PGHOST... would change what the
// programs do) and sets LC_ALL=C so messages are English and initdb never trips on
// a locale that is not installed.
func childEnv(env []string) []string {
	out := make([]string, 0, len(env)+1)
	for _, kv := range env {
		if strings.HasPrefix(kv, "PG") || strings.HasPrefix(kv, "LC_ALL=") {
			continue
		}
		out = append(out, kv)
	}
	return append(out, "LC_ALL=C")
}

// exec runs a command and returns an error carrying its output when it fails.
func (r *runner) exec(ctx context.Context, what, prog string, args ...string) error {
	cmd := r.command(ctx, prog, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	// pg_ctl start forks the server with its output sent to the log file, but should
	// a child ever keep our pipe open, do not wait for it forever.
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("pgembed: %s: %w: %s", what, err, strings.TrimSpace(out.String()))
	}
	return nil
}

// initdb creates the cluster: the superuser is "postgres" with the password in
// the password file (ensurePassword wrote it), every connection needs that
// password, and the locale is C so no installed locale is needed.
func (r *runner) initdb(ctx context.Context, pgdata string) error {
	r.cfg.Logger.Info("creating a new Postgres cluster (initdb; takes a few seconds)", "pgdata", pgdata, "version", r.bins.version)
	err := r.exec(ctx, "initdb", r.bins.initdb(),
		"--pgdata="+pgdata,
		"--username="+Superuser,
		"--auth=scram-sha-256",
		"--pwfile="+filepath.Join(r.cfg.Dir, passwordFile),
		"--encoding=UTF8",
		"--locale=C",
	)
	if err != nil {
		// Leave no half cluster behind: the next attempt would refuse the directory.
		_ = os.RemoveAll(pgdata)
		return err
	}
	return nil
}

// running asks pg_ctl whether the cluster's server runs, and on which port.
func (r *runner) running(ctx context.Context, pgdata string) (port int, ok bool, err error) {
	cmd := r.command(ctx, r.bins.pgCtl(), "status", "--pgdata="+pgdata)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit) && exit.ExitCode() == 3: // documented: not running
		return 0, false, nil
	default:
		return 0, false, fmt.Errorf("pgembed: pg_ctl status: %w: %s", err, strings.TrimSpace(string(out)))
	}
	// Line 4 of postmaster.pid is the port the running server listens on.
	b, err := readPlain(filepath.Join(pgdata, "postmaster.pid"), 4096)
	if err != nil {
		return 0, false, fmt.Errorf("pgembed: server runs but: %w", err)
	}
	lines := strings.Split(string(b), "\n")
	if len(lines) < 4 {
		return 0, false, fmt.Errorf("pgembed: unexpected postmaster.pid: %q", b)
	}
	port, err = strconv.Atoi(strings.TrimSpace(lines[3]))
	if err != nil {
		return 0, false, fmt.Errorf("pgembed: port in postmaster.pid: %w", err)
	}
	return port, true, nil
}

// start starts the server and waits until it accepts connections.
func (r *runner) start(ctx context.Context, pgdata string, port int) error {
	logPath := filepath.Join(r.cfg.Dir, logFile)
	// The server's settings are given at each start rather than written into
	// postgresql.conf, so they hold for any cluster this package starts:
	//   -p N                          the port (it may change between starts)
	//   listen_addresses=127.0.0.1    loopback only: a development cluster is no
	//                                 business of other machines
	//   -k ''                         no Unix sockets: nothing to create under
	//                                 /var/run/postgresql (which needs root), and no
	//                                 107-byte limit on the socket path under a deep Dir
	//   wal_level=logical             the log relay reads committed outbox rows from
	//                                 a logical replication slot
	// pg_ctl hands this string to /bin/sh, hence the quotes around the empty value.
	serverOpts := fmt.Sprintf("-p %d -c listen_addresses=127.0.0.1 -k '' -c wal_level=logical", port)
	err := r.exec(ctx, "pg_ctl start", r.bins.pgCtl(), "start",
		"--pgdata="+pgdata,
		"--log="+logPath,
		"--wait", "--timeout="+strconv.Itoa(int(r.cfg.StartTimeout.Seconds())),
		"-o", serverOpts,
	)
	if err != nil {
		return fmt.Errorf("%w\n--- last lines of %s ---\n%s", err, logPath, tail(logPath, 15))
	}
	return nil
}

// stop stops the server with a fast shutdown: sessions are disconnected and open
// transactions rolled back, then a clean checkpoint (no crash recovery next time).
// A server that is not running (someone else stopped it) is not an error.
func (r *runner) stop(ctx context.Context, pgdata string) error {
	if _, running, err := r.running(ctx, pgdata); err == nil && !running {
		return nil
	}
	return r.exec(ctx, "pg_ctl stop", r.bins.pgCtl(), "stop", "--pgdata="+pgdata, "--mode=fast", "--wait", "--timeout=60")
}

// tail returns the last n lines of a file (of its first MiB: the log of a cluster
// that failed to start is short), for error messages.
func tail(path string, n int) string {
	b, err := readPlain(path, 1<<20)
	if err != nil {
		return "(" + err.Error() + ")"
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
