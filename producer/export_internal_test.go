package producer

import (
	"testing"
	"time"
)

// Defaults the external tests check Config's zero fields against.
const (
	DefaultWait             = defaultWait
	DefaultMaxResponseBytes = defaultMaxResponseBytes
)

// SetClock sets m's wall clock, for tests of a clock that disagrees.
func SetClock(m *Middleware, now func() time.Time) { m.now = now }

// The watch reports a database clock that ran ahead of this process's by more
// than the tolerance, and keeps reporting it while the jump lasts; drift within
// the tolerance re-anchors.
func TestClockWatchSeesAJump(t *testing.T) {
	c := newClockWatch()
	t0 := time.Now()
	if _, j := c.check(t0); j {
		t.Fatal("the first reading is a jump")
	}
	if _, j := c.check(t0.Add(time.Minute)); j {
		t.Fatal("a minute of drift is a jump")
	}
	if skew, j := c.check(t0.Add(72 * time.Hour)); !j || skew < 71*time.Hour {
		t.Fatalf("three days ahead: skew %v, jump %v; want a jump", skew, j)
	}
	if _, j := c.check(t0.Add(72*time.Hour + time.Second)); !j {
		t.Fatal("the jump was forgotten at the next reading")
	}
	if _, j := c.check(t0.Add(2 * time.Minute)); j {
		t.Fatal("the clock came back and the watch still holds")
	}
}
