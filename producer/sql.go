package producer

// The middleware's statements that name no table: the request's transaction and
// its savepoints. idem_requests's own are in package store
// (internal/store/requests.go).
//
// Every statement runs inside the request's one transaction (see Middleware.Wrap).
const (
	// A request runs in a requestTx: BEGIN goes in one batch with the key's lock and
	// the lookup of its record (store.Requests.Lock, Lookup), COMMIT in one with the
	// outbox INSERTs and the key's record. Extended-protocol statements, one per
	// message, so no SET LOCAL can ride along: the lock statement sets the lock
	// timeout itself.
	sqlBeginRequest    = `BEGIN`
	sqlCommitRequest   = `COMMIT`
	sqlRollbackRequest = `ROLLBACK`
	// sqlNoop changes nothing; requestTx.LargeObjects sends it where pgx sends BEGIN.
	sqlNoop = `SELECT 1`

	// A handler's nested transaction (Intent.Tx.Begin) is a savepoint, named
	// idem_sp_<n> (appended), as pgx's own nested transactions are.
	sqlSavepoint           = `SAVEPOINT `
	sqlReleaseSavepoint    = `RELEASE SAVEPOINT `
	sqlRollbackToSavepoint = `ROLLBACK TO SAVEPOINT `
)
