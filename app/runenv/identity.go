package runenv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/app/pgembed"
)

// DatabaseFile, under DataDir, records the database the data dir's worker uses.
// A data dir's JetStream store and its database go together: the stream holds
// messages relayed from that database's outbox, its durable consumers' progress
// matches that database's inbox. So the first start records the database, and
// later starts refuse any other (see Open).
const DatabaseFile = "database.json"

// DatabaseRecord is the content of DatabaseFile.
type DatabaseRecord struct {
	// SystemIdentifier is the cluster's pg_control_system().system_identifier,
	// unique per initdb: it tells two servers apart whatever their URL.
	SystemIdentifier string `json:"system_identifier"`
	// Database is the database's name within the cluster.
	Database string `json:"database"`
	// Private says the worker runs on the private cluster under DataDir/postgres;
	// otherwise on the database at URL it was given (or the default URL).
	Private bool `json:"private"`
	// URL is where the worker connected, without its password.
	URL string `json:"url"`
	// RecordedAt is when the record was made.
	RecordedAt time.Time `json:"recorded_at"`
}

// ReadDatabaseRecord returns the record in dataDir, or nil when there is none yet
// (a new data dir, or one from a version that kept no record).
func ReadDatabaseRecord(dataDir string) (*DatabaseRecord, error) {
	path := filepath.Join(dataDir, DatabaseFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the data dir's database record: %w", err)
	}
	var r DatabaseRecord
	if err := json.Unmarshal(b, &r); err != nil || r.SystemIdentifier == "" {
		return nil, fmt.Errorf("%s is not a database record (%v): delete it, and the next start records the database it finds", path, err)
	}
	return &r, nil
}

// writeDatabaseRecord records r in dataDir.
func writeDatabaseRecord(dataDir string, r DatabaseRecord) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := writePrivateFile(filepath.Join(dataDir, DatabaseFile), append(b, '\n')); err != nil {
		return fmt.Errorf("record the data dir's database: %w", err)
	}
	return nil
}

// Queryer is what Identify needs: a pool, a connection or a transaction.
type Queryer interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Identify returns the identity of the database db is connected to: its cluster's
// system identifier and its name.
func Identify(ctx context.Context, db Queryer) (systemIdentifier, database string, err error) {
	err = db.QueryRow(ctx, `SELECT system_identifier::text, current_database() FROM pg_control_system()`).Scan(&systemIdentifier, &database)
	if err != nil {
		return "", "", fmt.Errorf("identify the database (pg_control_system): %w", err)
	}
	return systemIdentifier, database, nil
}

// Check returns nil when the database at url (connected as db) is the recorded
// one, and otherwise an error naming both, and how to proceed.
func (r *DatabaseRecord) Check(ctx context.Context, db Queryer, dataDir, url string) error {
	id, name, err := Identify(ctx, db)
	if err != nil {
		return err
	}
	if id == r.SystemIdentifier && name == r.Database {
		return nil
	}
	which := "the database at that URL"
	if r.Private {
		which = "its private Postgres under " + filepath.Join(dataDir, pgembed.Subdir)
	}
	return fmt.Errorf("data dir %s belongs to database %q of Postgres cluster %s at %s (%s, recorded in %s on %s), "+
		"but %s is database %q of cluster %s. "+
		"The data dir's JetStream store holds what that database's outbox relayed and its consumers' progress, so the two must not be mixed: "+
		"give this database a --data-dir of its own (IDEM_DATA_DIR), or, if the move was deliberate (a restored backup, a new server), "+
		"delete %s and start again",
		dataDir, r.Database, r.SystemIdentifier, r.URL, which, filepath.Join(dataDir, DatabaseFile), r.RecordedAt.Format(time.DateOnly),
		Redact(url), name, id, filepath.Join(dataDir, DatabaseFile))
}
