package migrations_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem/internal/testkit/pgtest"
	"github.com/idemkit/idem/migrations"
)

func tablesIn(t *testing.T, db *pgtest.DB, schema string) int {
	t.Helper()
	return db.Count(t, `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name LIKE 'idem\_%'`, schema)
}

// Ten workers migrating one empty database at once: the advisory lock serialises
// them, every version is applied once, and all of them succeed.
func TestConcurrentApply(t *testing.T) {
	t.Parallel()
	db := pgtest.NewWith(t, pgtest.Options{NoMigrate: true})
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg  sync.WaitGroup
		mu  sync.Mutex
		ran int
	)
	for range 10 {
		wg.Go(func() {
			applied, err := migrations.Apply(context.Background(), db.Pool, migrations.Config{})
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			ran += len(applied)
			mu.Unlock()
		})
	}
	wg.Wait()
	if ran != len(all) {
		t.Errorf("%d files applied across 10 migrators, want each of the %d once", ran, len(all))
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_schema_migrations`); n != len(all) {
		t.Errorf("versions recorded = %d, want %d", n, len(all))
	}
	if err := migrations.Check(context.Background(), db.Pool, migrations.Config{}); err != nil {
		t.Errorf("Check after Apply: %v", err)
	}
}

// A schema of the user's choosing gets every table; public gets none.
func TestApplyIntoASchema(t *testing.T) {
	t.Parallel()
	db := pgtest.NewWith(t, pgtest.Options{NoMigrate: true})
	if _, err := migrations.Apply(context.Background(), db.Pool, migrations.Config{Schema: "billing_idem"}); err != nil {
		t.Fatal(err)
	}
	if n := tablesIn(t, db, "billing_idem"); n < 5 {
		t.Errorf("billing_idem holds %d idem tables, want the 4 tables and the version table", n)
	}
	if n := tablesIn(t, db, "public"); n != 0 {
		t.Errorf("public holds %d idem tables, want none", n)
	}
	if err := migrations.Check(context.Background(), db.Pool, migrations.Config{}); !errors.Is(err, migrations.ErrNotMigrated) {
		t.Errorf("Check of public = %v, want ErrNotMigrated", err)
	}
	if _, err := migrations.Apply(context.Background(), db.Pool, migrations.Config{Schema: "Billing"}); err == nil {
		t.Error("a schema name that is not a lower-case identifier was accepted")
	}
}

// The printed SQL, run by another tool, leaves nothing for Apply to do.
func TestSQLIsWhatApplyWouldDo(t *testing.T) {
	t.Parallel()
	db := pgtest.NewWith(t, pgtest.Options{NoMigrate: true})
	ctx := context.Background()
	if err := migrations.Check(ctx, db.Pool, migrations.Config{Schema: "ext"}); !errors.Is(err, migrations.ErrNotMigrated) || !strings.Contains(err.Error(), "worker migrate") {
		t.Errorf("Check of an empty database = %v, want ErrNotMigrated naming the way out", err)
	}
	sql, err := migrations.SQL(migrations.Config{Schema: "ext"})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`CREATE SCHEMA IF NOT EXISTS "ext"`, "CREATE TABLE IF NOT EXISTS idem_inbox", "INSERT INTO idem_schema_migrations"} {
		if !strings.Contains(sql, want) {
			t.Errorf("SQL lacks %q", want)
		}
	}
	// Simple protocol: the script is several statements, as psql would send it.
	if _, err := db.Pool.Exec(ctx, sql); err != nil {
		t.Fatalf("running the printed SQL: %v", err)
	}
	if err := migrations.Check(ctx, db.Pool, migrations.Config{Schema: "ext"}); err != nil {
		t.Errorf("Check after the printed SQL: %v", err)
	}
	applied, err := migrations.Apply(ctx, db.Pool, migrations.Config{Schema: "ext"})
	if err != nil || len(applied) != 0 {
		t.Errorf("Apply after the printed SQL applied %v (%v), want nothing", applied, err)
	}
	// Running it twice is harmless.
	if _, err := db.Pool.Exec(ctx, sql); err != nil {
		t.Errorf("running the printed SQL again: %v", err)
	}
}

// Check's error names the way out in the library's terms: an embedder has no
// `worker` binary, only migrations.Apply and migrations.SQL.
func TestCheckNamesTheLibrarysWayOut(t *testing.T) {
	t.Parallel()
	db := pgtest.NewWith(t, pgtest.Options{NoMigrate: true})
	ctx := context.Background()
	wantNamed := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, migrations.ErrNotMigrated) {
			t.Fatalf("Check of %s = %v, want ErrNotMigrated", what, err)
		}
		for _, want := range []string{"migrations.Apply", "migrations.SQL", "`worker migrate`"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("Check of %s does not name %s: %v", what, want, err)
			}
		}
	}
	wantNamed("an empty schema", migrations.Check(ctx, db.Pool, migrations.Config{}))
	if _, err := migrations.Apply(ctx, db.Pool, migrations.Config{}); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `DELETE FROM idem_schema_migrations WHERE version = (SELECT max(version) FROM idem_schema_migrations)`); err != nil {
		t.Fatal(err)
	}
	err := migrations.Check(ctx, db.Pool, migrations.Config{})
	wantNamed("a schema missing its last migration", err)
	if err != nil && !strings.Contains(err.Error(), "lacks") {
		t.Errorf("Check does not say what is missing: %v", err)
	}
}

// Each installation (a schema of a database) gets a token of its own, made once:
// the printed SQL run again keeps it.
func TestEachInstallationGetsItsOwnToken(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t)
	if _, err := migrations.Apply(ctx, db.Pool, migrations.Config{Schema: "billing_idem"}); err != nil {
		t.Fatal(err)
	}
	token := func(schema string) string {
		t.Helper()
		var tok string
		if err := db.Pool.QueryRow(ctx, `SELECT token::text FROM `+schema+`.idem_installation`).Scan(&tok); err != nil {
			t.Fatal(err)
		}
		return tok
	}
	public, billing := token("public"), token("billing_idem")
	if public == billing {
		t.Errorf("two schemas share the token %s", public)
	}
	sql, err := migrations.SQL(migrations.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, sql); err != nil {
		t.Fatal(err)
	}
	if n := db.Count(t, `SELECT count(*) FROM idem_installation`); n != 1 || token("public") != public {
		t.Errorf("after the SQL ran again: %d rows, token %s; want the one row of token %s", n, token("public"), public)
	}
}
