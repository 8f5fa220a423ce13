package runenv

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"github.com/gofrs/flock"
)

// LockFile, under DataDir, is held (flock) by the worker using the directory, for
// as long as it runs. Operator commands do not take it: they run beside a worker.
const LockFile = "lock"

// DefaultDataDir is the data directory when none is given: $XDG_STATE_HOME/idem,
// else ~/.local/state/idem, and /var/lib/idem for root (whose home is usually
// closed to the postgres system user that runs a private cluster). It is absolute,
// so the operator commands find a running worker's files from any working
// directory. (cmd/worker puts $IDEM_DATA_DIR before it.)
func DefaultDataDir() (string, error) {
	// The XDG spec says a relative path in the variable is to be ignored.
	if s := os.Getenv("XDG_STATE_HOME"); s != "" && filepath.IsAbs(s) {
		return filepath.Join(s, "idem"), nil
	}
	if os.Geteuid() == 0 {
		return "/var/lib/idem", nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("no data directory: %w; set --data-dir or IDEM_DATA_DIR", err)
	}
	return filepath.Join(home, ".local", "state", "idem"), nil
}

// prepareDataDir creates dir when it is missing, closed to other users: 0700, or
// 0711 under root, where the postgres system user must pass through it to reach a
// private cluster below (it can list nothing, and every file in it is 0600). An
// existing dir must belong to this user and be writable by nobody else: another
// user who could write there could replace nats.url (and send the operator
// commands to a server of theirs) or hold the lock.
func prepareDataDir(dir string) error {
	perm := os.FileMode(0o700)
	if os.Geteuid() == 0 {
		perm = 0o711
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return fmt.Errorf("data dir: %w", err)
	}
	if err := os.Mkdir(dir, perm); err == nil {
		// Mkdir's mode passes through the umask; say what we mean.
		if err := os.Chmod(dir, perm); err != nil {
			return fmt.Errorf("data dir: %w", err)
		}
		return nil
	} else if !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("data dir: %w", err)
	}
	fi, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("data dir: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("data dir %s is not a directory", dir)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("data dir %s belongs to uid %d, not to this user (uid %d): give this worker a directory of its own with --data-dir",
			dir, st.Uid, os.Geteuid())
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("data dir %s is writable by other users (mode %04o), who could replace the files the worker and the operator commands rely on: "+
			"chmod go-w %s, or choose another --data-dir", dir, fi.Mode().Perm(), dir)
	}
	return nil
}

// lockDataDir takes the worker's exclusive lock on dir, without waiting: a second
// worker on the same directory would run a second JetStream server on the same
// store and overwrite nats.url.
func lockDataDir(dir string) (*flock.Flock, error) {
	path := filepath.Join(dir, LockFile)
	l := flock.New(path)
	ok, err := l.TryLock()
	if err != nil {
		return nil, fmt.Errorf("lock the data dir: %w", err)
	}
	if !ok {
		return nil, fmt.Errorf("another worker is running on data dir %s (it holds %s): stop it, or give this worker its own --data-dir", dir, path)
	}
	return l, nil
}

// writePrivateFile replaces path with data, mode 0600, atomically: a reader sees
// the old content or the new, and a file an earlier version wrote with another
// mode is replaced, not reused with its mode.
func writePrivateFile(path string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	_, werr := f.Write(data)
	if werr == nil {
		werr = f.Sync()
	}
	if err := errors.Join(werr, f.Close()); err != nil {
		os.Remove(f.Name())
		return err
	}
	// CreateTemp makes the file 0600 already.
	if err := os.Rename(f.Name(), path); err != nil {
		os.Remove(f.Name())
		return err
	}
	return nil
}
