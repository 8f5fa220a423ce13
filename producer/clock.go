package producer

import (
	"sync"
	"time"
)

// clockJumpTolerance is how far the database's clock may run ahead of this
// process's monotonic clock, since the last lookup that agreed, before the
// ingress stops forgetting expired records. Slow drift and the small steps of time
// synchronisation stay far below it.
const clockJumpTolerance = 5 * time.Minute

// clockWatch compares the database's clock, as each lookup of a record returns it,
// with this process's monotonic clock. While the database's has run ahead by more
// than clockJumpTolerance since the last reading that agreed, it reports a jump:
// an expired record is then replayed, not forgotten and executed again. It costs
// no statement: the lookup returns now() beside the record. A new process takes
// the database's clock as it finds it; against a jump that was already there, the
// other check (the record must be expired by this process's wall clock too) holds
// as long as the two hosts' clocks are not the same one.
type clockWatch struct {
	start time.Time // monotonic reference

	mu       sync.Mutex
	anchored bool
	db       time.Time
	at       time.Duration
}

func newClockWatch() *clockWatch { return &clockWatch{start: time.Now()} }

// check records a reading of the database's clock and reports how far it ran
// ahead of this process's since the last reading that agreed, and whether that is
// a jump. A jump is not re-anchored on: it lasts as long as the database's clock
// stays ahead.
func (c *clockWatch) check(dbNow time.Time) (time.Duration, bool) {
	mono := time.Since(c.start)
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.anchored {
		c.anchored, c.db, c.at = true, dbNow, mono
		return 0, false
	}
	skew := dbNow.Sub(c.db) - (mono - c.at)
	if skew > clockJumpTolerance {
		return skew, true
	}
	c.db, c.at = dbNow, mono
	return skew, false
}
