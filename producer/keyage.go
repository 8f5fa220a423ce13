package producer

import (
	"encoding/binary"
	"time"

	"github.com/google/uuid"

	"github.com/idemkit/idem"
)

// maxKeyAgeMargin bounds how much sooner than KeyLifetime a key counts as too old
// (keyAgeLimit).
const maxKeyAgeMargin = time.Hour

// keyAgeLimit is the age past which a key that has no live record is refused
// rather than executed: KeyLifetime less a margin (a quarter of it, at most
// maxKeyAgeMargin) for the clocks involved, the client's that stamped the key and
// the database's that expires records, which are not this process's.
//
// The rule it enforces: a record lives KeyLifetime from the key's first arrival,
// which is after the key was minted. So a key younger than KeyLifetime that has
// no record was never seen, or was refused, and executing it is its first time;
// an older one may name a request that executed and was forgotten since.
func keyAgeLimit(lifetime time.Duration) time.Duration {
	return lifetime - min(lifetime/4, maxKeyAgeMargin)
}

// keyTooOld reports whether key carries its minting time (a UUIDv7, as idem.NewKey
// mints) and is older than keyAgeLimit at now, with its age. Other keys carry no
// time and are never too old.
func (m *Middleware) keyTooOld(key idem.Key, now time.Time) (time.Duration, bool) {
	minted, ok := uuidV7Time(string(key))
	if !ok {
		return 0, false
	}
	age := now.Sub(minted)
	return age, age > m.keyAgeLimit
}

// uuidV7Time is the creation time of s when s is a UUIDv7 in its canonical text
// form (8-4-4-4-12 hex digits): its first 48 bits are Unix milliseconds.
func uuidV7Time(s string) (time.Time, bool) {
	if len(s) != 36 {
		return time.Time{}, false // uuid.Parse also takes other forms; a key is compared as text
	}
	id, err := uuid.Parse(s)
	if err != nil || id.Version() != 7 || id.Variant() != uuid.RFC4122 {
		return time.Time{}, false
	}
	var ms [8]byte
	copy(ms[2:], id[:6])
	return time.UnixMilli(int64(binary.BigEndian.Uint64(ms[:]))), true
}
