package consumer

import (
	"context"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// Only a 4xx other than a missing stream stops a consumer from starting: a server
// that failed (the "consumer closed" a stream deletion causes) or did not answer
// is waited out.
func TestRefused(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"server error while its stream is deleted", &jetstream.APIError{Code: 500, ErrorCode: 10012, Description: "consumer closed"}, false},
		{"stream not found", jetstream.ErrStreamNotFound, false},
		{"wrapped stream not found", fmt.Errorf("create: %w", jetstream.ErrStreamNotFound), false},
		{"timeout", context.DeadlineExceeded, false},
		{"bad configuration", &jetstream.APIError{Code: 400, ErrorCode: 10093, Description: "consumer filter subject is not a valid subset of the interest subjects"}, true},
		{"wrapped bad configuration", fmt.Errorf("create: %w", &jetstream.APIError{Code: 400, ErrorCode: 10013}), true},
	} {
		if got := refused(tc.err); got != tc.want {
			t.Errorf("%s: refused = %v, want %v", tc.name, got, tc.want)
		}
	}
}
