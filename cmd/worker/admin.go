package main

// The operator subcommands that change or probe state: migrate, dead-letters,
// healthcheck. inspect.go and stats.go read.

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/migrations"
	"github.com/idemkit/idem/refapp"
)

func openPool(ctx context.Context, o *options) (*pgxpool.Pool, error) {
	pool, err := pgxpool.New(ctx, o.databaseURL)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("database: no Postgres answers: %w", err)
	}
	return pool, nil
}

func runMigrate(args []string, stdout, stderr io.Writer) error {
	var print bool
	o, fs, rest, err := parseOps("worker migrate", "usage: worker migrate [--print] [flags]\n\nApplies idem's schema and the application's tables, or with --print writes their SQL\n(for goose, atlas or psql) without connecting.\n\nflags:\n", args, stderr, func(fs *flag.FlagSet) {
		fs.BoolVar(&print, "print", false, "write the SQL to stdout instead of applying it")
	})
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return fmt.Errorf("migrate: unexpected arguments %q", rest)
	}
	if print {
		sql, err := migrations.SQL(migrations.Config{Schema: o.schema})
		if err != nil {
			return err
		}
		fmt.Fprint(stdout, sql)
		fmt.Fprintf(stdout, "\n-- The reference application's tables.\n%s", refapp.SchemaSQL)
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	pool, err := openOpsPool(ctx, o, fs)
	if err != nil {
		return err
	}
	defer pool.Close()
	applied, err := migrations.Apply(ctx, pool, migrations.Config{Schema: o.schema})
	if err != nil {
		return err
	}
	if err := refapp.Migrate(ctx, pool); err != nil {
		return err
	}
	if len(applied) == 0 {
		fmt.Fprintln(stdout, "schema is up to date")
	}
	for _, a := range applied {
		fmt.Fprintln(stdout, "applied", a)
	}
	return nil
}

const deadLettersUsage = `usage:
  worker dead-letters list [flags]       dead letters as JSON lines, newest first
  worker dead-letters replay [flags] ID  put dead letter ID back on its way: it is
                                         written to the outbox with its original key
                                         and published by the running relay

flags:
`

func runDeadLetters(args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		return errors.New("dead-letters: want list or replay ID")
	}
	sub, args := args[0], args[1:]
	if sub != "list" && sub != "replay" {
		return fmt.Errorf("dead-letters: unknown subcommand %q (want list or replay)", sub)
	}
	o, fs, rest, err := parseOps("worker dead-letters "+sub, deadLettersUsage, args, stderr, nil)
	if err != nil {
		return err
	}
	var id int64
	if sub == "replay" {
		if len(rest) != 1 {
			return errors.New("dead-letters replay: want exactly one ID")
		}
		if id, err = strconv.ParseInt(rest[0], 10, 64); err != nil {
			return fmt.Errorf("dead-letters replay: bad ID %q", rest[0])
		}
	} else if len(rest) > 0 {
		return fmt.Errorf("dead-letters list: unexpected arguments %q", rest)
	}
	ctx, cancel := context.WithTimeout(context.Background(), opsTimeout)
	defer cancel()
	pool, err := openOpsPool(ctx, o, fs)
	if err != nil {
		return err
	}
	defer pool.Close()
	dls, err := consumer.NewDeadLetters(pool, o.schema)
	if err != nil {
		return err
	}
	switch sub {
	case "list":
		list, err := dls.List(ctx, 1000)
		if err != nil {
			return err
		}
		enc := json.NewEncoder(stdout)
		for _, dl := range list {
			if err := enc.Encode(dl); err != nil {
				return err
			}
		}
		fmt.Fprintf(stderr, "%d dead letters\n", len(list))
		return nil
	default:
		dl, err := dls.Replay(ctx, id)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "replayed dead letter %d (key %q, subject %s): queued in the outbox for the relay\n", dl.ID, dl.Key, dl.Subject)
		return nil
	}
}

// runHealthcheck asks a running worker's /readyz; for container health checks,
// where the image has no curl.
func runHealthcheck(args []string, stderr io.Writer) error {
	o, _, _, err := parse("worker healthcheck", args, stderr)
	if err != nil {
		return err
	}
	client := &http.Client{Timeout: 3 * time.Second}
	resp, err := client.Get("http://" + o.httpAddr + "/readyz")
	if err != nil {
		return fmt.Errorf("healthcheck: %w", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("healthcheck: %s: %s", resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}
