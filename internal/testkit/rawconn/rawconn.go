// Package rawconn speaks to a server in raw bytes, for tests of what a
// well-behaved HTTP client never sends (a request smuggled in another's body).
package rawconn

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// Exchange writes stream on a new connection to addr and reads until the server
// closes it, or until wait has passed: closed says which.
func Exchange(t testing.TB, addr, stream string, wait time.Duration) (responses string, closed bool) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, stream); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(wait))
	var out bytes.Buffer
	_, err = io.Copy(&out, c)
	var ne net.Error
	return out.String(), !(errors.As(err, &ne) && ne.Timeout())
}
