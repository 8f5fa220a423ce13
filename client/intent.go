package client

import (
	"time"

	"github.com/idemkit/idem"
)

// IntentStatus is where an intent stands, as the client sees it.
type IntentStatus string

const (
	// IntentPending: no final response has been recorded. Resume re-sends it with
	// its own key. An intent answered with a redirect stays pending too: a redirect
	// is not the service's answer (see ErrRedirected).
	IntentPending IntentStatus = "pending"
	// IntentDone: a 2xx response was received and recorded.
	IntentDone IntentStatus = "done"
	// IntentRejected: a final 4xx response was received and recorded. Re-sending the
	// same request would be rejected again.
	IntentRejected IntentStatus = "rejected"
	// IntentExpired: still pending, but older than Config.KeyLifetime, or of an age
	// that cannot be known (a CreatedAt in the future: the clock was set back). It
	// is never re-sent: the server may have forgotten the key, and a late retry would
	// then be a second effect. A Store never stores this status; the Client derives
	// it from CreatedAt (see Client.Expired).
	IntentExpired IntentStatus = "expired"
)

// Intent is one user intent as recorded in a Store.
type Intent struct {
	// Key names the intent. It was minted before the first send.
	Key idem.Key
	// Scope is sent as Idempotency-Scope when not empty.
	Scope string
	// Method and Path of the HTTP request, for example "POST" "/v1/payments".
	Method, Path string
	// Payload is the request body, byte for byte what every attempt sends: the
	// server rejects a key reused with a different body.
	Payload []byte
	// CreatedAt is when the intent was journaled, by the wall clock: a Store keeps
	// nothing else. The key lifetime counts from here (see Client.Expired).
	CreatedAt time.Time
	// Attempts counts sends started with this key, across processes.
	Attempts int
	// Status is IntentPending, IntentDone or IntentRejected.
	Status IntentStatus
	// HTTPStatus and Response are the final response, once Status is not pending.
	HTTPStatus int
	Response   []byte
	// FinishedAt is when the final response was recorded.
	FinishedAt time.Time
}
