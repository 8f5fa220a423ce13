package client

import (
	"context"

	"github.com/idemkit/idem"
)

// Store is where a Client keeps its intents: *Journal is the file-backed one, and an
// application that already has a local database (SQLite on a phone, say) can keep
// its intents there instead.
//
// The contract below is what makes a key outlive a crash. "Durable" means the write
// survives the process dying and the machine losing power right after the method
// returns: an fsync, a committed transaction. The errors named are matched with
// errors.Is; a Store may wrap them. A Store must be safe for concurrent use, as a
// Client is.
//
// Every method takes the ctx of the Client call it serves (Submit, Resume, List). A
// Store backed by a database passes it to its queries and may fail once it ends,
// with an error that wraps ctx.Err(); a nil error still means the write is durable.
// The Journal ignores ctx.
type Store interface {
	// Append records a new pending intent: Key, Scope, Method, Path, Payload and the
	// CreatedAt instant as given, Attempts 0, Status IntentPending. It must be
	// durable before it returns nil: the Client sends the key only after that, so a
	// key on the wire is always a key the store still has after a restart. It fails
	// for a key the store already holds (ErrDuplicateIntent), never overwriting it.
	// When it fails the Client does not send the intent, and Submit reports it as
	// never sent; a Store that cannot rule out having kept it (a commit whose answer
	// was lost) leaves an intent that a later Resume will send.
	Append(ctx context.Context, in Intent) error
	// RecordAttempt adds one to the intent's Attempts. The Client calls it before
	// each send; it should be durable before it returns (Journal fsyncs it), but a
	// lost attempt only under-counts, it never causes a second send. It fails for an
	// unknown key (ErrUnknownIntent) or a finished intent (ErrIntentFinished), and
	// the Client then stops sending that intent; if it fails because ctx ended, the
	// intent stays pending (ErrStillPending).
	RecordAttempt(ctx context.Context, key idem.Key) error
	// Done records the final response (status IntentDone or IntentRejected, the
	// HTTP status, the body) and when it arrived (FinishedAt). It must be durable
	// before it returns nil; after it the intent is no longer pending. A Done lost
	// in a crash, or failed because ctx ended, only means the intent is sent once
	// more and the server replays its answer. It fails for an unknown key or an
	// intent that is already finished.
	Done(ctx context.Context, key idem.Key, httpStatus int, body []byte, status IntentStatus) error
	// Pending returns the intents without a final response, oldest first, with
	// Payload byte for byte as appended: every retry must send the same body, since
	// the server rejects a key reused with a different one. On error it returns no
	// intents, and Resume sends none.
	Pending(ctx context.Context) ([]Intent, error)
	// All returns every intent, pending or finished, oldest first. On error it
	// returns no intents.
	All(ctx context.Context) ([]Intent, error)
}

// The Journal is the reference implementation of the contract above.
var _ Store = (*Journal)(nil)
