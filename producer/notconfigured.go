package producer

import (
	"log/slog"
	"net/http"
)

// notConfiguredMsg says what a route behind a nil Middleware lacks, in the terms of
// the one place a nil Middleware comes from.
const notConfiguredMsg = "this route is behind a nil *producer.Middleware, which guards nothing: " +
	"a worker's Ingress() is nil when worker.Config.Ingress is left out; set it (&producer.Config{} for the defaults)"

// notConfigured is what Wrap gives on a nil Middleware. Running the handler
// unguarded would execute retries twice, and a nil dereference would only drop the
// connection: a 500 that says why reaches the client, and the log says it once, at
// start, where the route is wrapped.
func notConfigured() http.Handler {
	slog.Default().Error("producer: " + notConfiguredMsg)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		WriteError(w, http.StatusInternalServerError, codeNotConfigured, notConfiguredMsg)
	})
}
