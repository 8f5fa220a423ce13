package idemtest

import "github.com/idemkit/idem/internal/pgschema"

// All of the kit's SQL, in one place; newQueries qualifies it for the Env's schema.
const (
	// The consumer files a same-key-different-payload message with a reason that
	// starts with "fingerprint mismatch".
	sqlDeadLetterReasons = `SELECT reason FROM idem_dead_letters WHERE consumer = $1 AND key = $2 ORDER BY id`
)

// mismatchPrefix starts the reason of a fingerprint-mismatch dead letter.
const mismatchPrefix = "fingerprint mismatch"

type queries struct {
	deadLetterReasons string
}

func newQueries(schema string) queries {
	return queries{deadLetterReasons: pgschema.Qualify(schema, sqlDeadLetterReasons)}
}
