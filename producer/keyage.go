package producer

import (
	"encoding/binary"
	"fmt"
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
	return lifetime - keyAgeMargin(lifetime)
}

// keyAgeMargin is the allowance for the clocks: a quarter of lifetime, at most
// maxKeyAgeMargin. It also bounds how far ahead of this process's clock a key may
// be dated: a record lives KeyLifetime from the key's first arrival, and a key
// accepted at most a margin before its minting time still meets a live record for
// as long as keyAgeLimit lets it in.
func keyAgeMargin(lifetime time.Duration) time.Duration {
	return min(lifetime/4, maxKeyAgeMargin)
}

// keyAgeRefusal is the 422 a key with no live record gets for its age, if any.
// The policy for the client's clock:
//   - Behind: a key that looks older than keyAgeLimit is refused as
//     idempotency_key_expired, final: its first request may have executed and been
//     forgotten, and nothing here tells that from a fresh key minted on a clock that
//     runs late. The answer says how old the key looks, so a client that minted it
//     just now knows its clock is wrong.
//   - Ahead: a key dated more than keyAgeMargin ahead is refused as
//     idempotency_key_clock_skew. It never counts as young, which would let it in
//     after its record was collected. Not final: this process's clock only moves
//     on, so every earlier arrival of the key was refused too, and nothing of it
//     ever executed; the intent may be sent again under a key minted on a right
//     clock.
func (m *Middleware) keyAgeRefusal(key idem.Key, now time.Time) (code, msg string, refused bool) {
	minted, ok := uuidV7Time(string(key))
	if !ok {
		return "", "", false
	}
	switch age := now.Sub(minted); {
	case age > m.keyAgeLimit:
		return codeKeyExpired, fmt.Sprintf("this Idempotency-Key was minted %v ago, longer than this service remembers keys (%v): whether its request already took effect can no longer be told, so it is not executed. "+
			"Do not re-send this intent under a new key without checking that it did not take effect; mint a new key only for a new intent. "+
			"If the key was minted just now, the client's clock is about %v behind this service's (%s)",
			age.Round(time.Second), m.cfg.KeyLifetime, age.Round(time.Second), now.UTC().Format(time.RFC3339)), true
	case -age > m.keyAgeMargin:
		return codeKeyClockSkew, fmt.Sprintf("this Idempotency-Key is dated %v ahead of this service's clock (%s), more than the %v allowed: the client's clock is wrong. "+
			"Nothing was executed or stored under this key, ever; send the intent again under a key minted on a corrected clock (or one dated by this service's Date header)",
			(-age).Round(time.Second), now.UTC().Format(time.RFC3339), m.keyAgeMargin), true
	}
	return "", "", false
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
