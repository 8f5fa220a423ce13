package pgembed

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The superuser logs in over TCP with a password generated for the cluster
// (scram-sha-256), kept in <Dir>/password with mode 0600. Trust authentication
// would let any local user of the machine connect as the superuser and, through
// COPY ... TO PROGRAM, run commands as the postgres system user. (The other way to
// close the cluster, a Unix socket in a 0700 directory, is limited to a 107-byte
// path, which a deep --data-dir exceeds, and the operator commands could not find
// it from the port alone.)

// hbaRules replace the pg_hba.conf of a cluster an earlier version created with
// trust authentication. They are what initdb --auth=scram-sha-256 writes.
var hbaRules = []string{
	"# Rewritten by idem (internal/pgembed): every login needs the superuser's",
	"# password, which is kept in the password file beside the cluster directory.",
	"local   all             all                                     scram-sha-256",
	"host    all             all             127.0.0.1/32            scram-sha-256",
	"host    all             all             ::1/128                 scram-sha-256",
	"local   replication     all                                     scram-sha-256",
	"host    replication     all             127.0.0.1/32            scram-sha-256",
	"host    replication     all             ::1/128                 scram-sha-256",
}

// newPassword returns 32 random bytes in hex: URL-safe, and safe inside a quoted
// SQL literal.
func newPassword() (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("pgembed: generate a password: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// readPassword returns the password recorded in path, "" when there is none (a
// cluster an earlier version created, not yet closed).
func readPassword(path string) (string, error) {
	b, err := readPlain(path, 1024)
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("pgembed: read the superuser's password: %w", err)
	}
	pw := strings.TrimSpace(string(b))
	if pw == "" || strings.ContainsAny(pw, "'\\@/:?# \t") {
		return "", fmt.Errorf("pgembed: %s does not hold a password pgembed wrote (remove it only together with the cluster)", path)
	}
	return pw, nil
}

// ensurePassword returns the recorded password, generating and recording one when
// there is none. Under root the file belongs to the postgres system user, because
// initdb, which runs as that user, reads it (--pwfile).
func (r *runner) ensurePassword() (string, error) {
	path := filepath.Join(r.cfg.Dir, passwordFile)
	pw, err := readPassword(path)
	if err != nil || pw != "" {
		return pw, err
	}
	if pw, err = newPassword(); err != nil {
		return "", err
	}
	if err := writePlain(path, []byte(pw+"\n"), 0o600, r.as); err != nil {
		return "", fmt.Errorf("pgembed: record the superuser's password: %w", err)
	}
	return pw, nil
}

// closeTrust makes sure the running cluster at url (which carries the password)
// trusts nobody. A cluster an earlier version created with --auth=trust gets the
// password set on its superuser, a pg_hba.conf requiring it, and a reload; a
// cluster that already requires it is left alone. Each step can be repeated, so a
// process killed half way finishes the job at its next start.
func (r *runner) closeTrust(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && (pgErr.Code == "28P01" || pgErr.Code == "28000") {
			return fmt.Errorf("pgembed: the private cluster refuses the password in %s: %w "+
				"(was the file replaced? restore it, or remove %s to start an empty cluster)",
				filepath.Join(r.cfg.Dir, passwordFile), err, r.cfg.Dir)
		}
		return fmt.Errorf("pgembed: connect to the private cluster: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))

	var version int
	if err := conn.QueryRow(ctx, `SELECT current_setting('server_version_num')::int`).Scan(&version); err != nil {
		return fmt.Errorf("pgembed: server version: %w", err)
	}
	if version < 100000 {
		return errors.New("pgembed: the private cluster runs PostgreSQL before 10, which has no scram-sha-256: " +
			"set DATABASE_URL to a server you secure yourself")
	}
	var open int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_hba_file_rules WHERE auth_method <> 'scram-sha-256' OR error IS NOT NULL`).Scan(&open); err != nil {
		return fmt.Errorf("pgembed: read pg_hba.conf: %w", err)
	}
	if open == 0 {
		return nil
	}
	r.cfg.Logger.WarnContext(ctx, "the private Postgres trusts every local user (created by an earlier version); "+
		"setting a password and rewriting pg_hba.conf", "dir", r.cfg.Dir)

	// The password comes from newPassword (hex), so quoting it as a literal is safe.
	pw, err := readPassword(filepath.Join(r.cfg.Dir, passwordFile))
	if err != nil {
		return err
	}
	var hbaFile string
	if err := conn.QueryRow(ctx, `SHOW hba_file`).Scan(&hbaFile); err != nil {
		return fmt.Errorf("pgembed: hba_file: %w", err)
	}
	// The server writes its own pg_hba.conf (COPY runs as the postgres user that
	// owns it), so this process, root or not, writes nothing inside the cluster.
	// COPY's text format leaves these lines as they are: no tabs or backslashes.
	rows := make([]string, len(hbaRules))
	for i, l := range hbaRules {
		rows[i] = "(" + quote(l) + ")"
	}
	steps := []struct{ what, sql string }{
		{"choose scram-sha-256", `SET password_encryption = 'scram-sha-256'`},
		{"set the superuser's password", `ALTER ROLE ` + Superuser + ` PASSWORD ` + quote(pw)},
		{"rewrite " + hbaFile, `COPY (SELECT line FROM (VALUES ` + strings.Join(rows, ", ") + `) AS rules (line)) TO ` + quote(hbaFile)},
		{"reload", `SELECT pg_reload_conf()`},
	}
	for _, s := range steps {
		if _, err := conn.Exec(ctx, s.sql); err != nil {
			return fmt.Errorf("pgembed: close the trust cluster: %s: %w", s.what, err)
		}
	}
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_hba_file_rules WHERE auth_method <> 'scram-sha-256' OR error IS NOT NULL`).Scan(&open); err != nil || open != 0 {
		return fmt.Errorf("pgembed: pg_hba.conf still has %d rules without a password after the rewrite (%v): see %s", open, err, hbaFile)
	}
	return waitRefused(ctx, url)
}

// waitRefused returns once the server refuses a login without the password:
// pg_reload_conf only signals the postmaster, which reads pg_hba.conf again a
// moment later, and Ensure must not return while the cluster is still open.
func waitRefused(ctx context.Context, url string) error {
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		return fmt.Errorf("pgembed: %w", err)
	}
	cfg.Password = ""
	for {
		conn, err := pgconn.ConnectConfig(ctx, cfg)
		if err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) { // the server itself refused the login
				return nil
			}
			return fmt.Errorf("pgembed: check that the private cluster requires its password: %w", err)
		}
		_ = conn.Close(ctx)
		select {
		case <-ctx.Done():
			return fmt.Errorf("pgembed: the private cluster still lets a login without the password in after the reload: %w", ctx.Err())
		case <-time.After(50 * time.Millisecond): // the postmaster's reload is not observable otherwise
		}
	}
}

// quote makes s a standard SQL string literal.
func quote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}
