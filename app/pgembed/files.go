package pgembed

import (
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
)

// The files pgembed keeps beside the cluster (port, password, lock) live in a
// directory that, under root, belongs to the postgres system user. That user could
// replace any of them with a symlink to one of root's files, and root would then
// write, chown or show in an error message whatever the link points at. So each is
// opened with O_NOFOLLOW (a symlink is refused, never followed) and checked to be a
// plain file with one link before anything is written to it. The directory itself
// cannot be swapped: its parent belongs to this process's user.

// errSymlink explains a refusal; it is wrapped with the path.
var errSymlink = errors.New("is a symlink, not the plain file pgembed keeps there; refusing to follow it: remove it")

// openPlain opens path without following a symlink and checks that it is a plain
// file with a single link (a hard link to someone else's file is refused too).
func openPlain(path string, flag int, perm os.FileMode) (*os.File, error) {
	// O_NONBLOCK: a FIFO planted under the name must not hang the open; it is then
	// refused as not a plain file. (It changes nothing for a plain file.)
	f, err := os.OpenFile(path, flag|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, perm)
	if err != nil {
		if errors.Is(err, syscall.ELOOP) {
			return nil, fmt.Errorf("%s %w", path, errSymlink)
		}
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%s is not a plain file (%v); refusing to use it", path, fi.Mode().Type())
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Nlink > 1 {
		f.Close()
		return nil, fmt.Errorf("%s has %d hard links; refusing to use it: remove it", path, st.Nlink)
	}
	return f, nil
}

// readPlain reads at most limit bytes of path (the files are a few bytes; the log
// is read from its end by tail).
func readPlain(path string, limit int64) ([]byte, error) {
	f, err := openPlain(path, os.O_RDONLY, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, limit))
}

// writePlain replaces the content of path (created if missing) with data, sets its
// mode to perm (also when it existed with another one) and, when owner is set,
// hands it to that user. The chmod and chown go through the open descriptor, so
// they apply to the file checked, not to whatever the name points at by then.
func writePlain(path string, data []byte, perm os.FileMode, owner *syscall.Credential) error {
	f, err := openPlain(path, os.O_WRONLY|os.O_CREATE, perm)
	if err != nil {
		return err
	}
	werr := func() error {
		if err := f.Truncate(0); err != nil {
			return err
		}
		if _, err := f.Write(data); err != nil {
			return err
		}
		if err := f.Chmod(perm); err != nil {
			return err
		}
		if owner != nil {
			if err := f.Chown(int(owner.Uid), int(owner.Gid)); err != nil {
				return err
			}
		}
		return f.Sync()
	}()
	return errors.Join(werr, f.Close())
}
