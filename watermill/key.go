package idemwatermill

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dedupe"
	"github.com/idemkit/idem/wire"
)

// keyOf returns the scoped idempotency key a message carries in its metadata:
// Idempotency-Key (which may already be a scoped key, as idem's relay stamps it),
// joined with Idempotency-Scope when that is set. Errors are permanent and wrap
// idem.ErrMissingKey or idem.ErrMalformedKey.
func keyOf(md message.Metadata) (string, error) {
	scope, key, err := idem.ParseScopedKey(md.Get(idem.HeaderKey))
	if err != nil {
		return "", Permanent(fmt.Errorf("%s metadata: %w", idem.HeaderKey, err))
	}
	if s := md.Get(idem.HeaderScope); s != "" {
		if scope != "" {
			return "", Permanent(fmt.Errorf("%w: %s is already scoped and %s is set too",
				idem.ErrMalformedKey, idem.HeaderKey, idem.HeaderScope))
		}
		if err := idem.ValidateScope(s); err != nil {
			return "", Permanent(fmt.Errorf("%s metadata: %w", idem.HeaderScope, err))
		}
		scope = s
	}
	return idem.ScopedKey(scope, key), nil
}

// deliveryOf names a message in the inbox: its scoped key and which of the intent's
// messages it is, its topic (the NATS subject) and the name its producer gave it
// (idem.HeaderMessage). A message handled outside a router has no topic in its
// context: its name alone, or "-", tells it apart then.
func deliveryOf(ctx context.Context, key string, md message.Metadata) (dedupe.ID, error) {
	name := md.Get(idem.HeaderMessage)
	if err := idem.ValidateMessageName(name); err != nil {
		return dedupe.ID{}, Permanent(fmt.Errorf("%s metadata: %w", idem.HeaderMessage, err))
	}
	id := dedupe.ID{Key: key, Message: name}
	switch topic := message.SubscribeTopicFromCtx(ctx); {
	case topic != "":
		id.Message = wire.MessageOf(topic, name)
	case name == "":
		id.Message = "-"
	}
	return id, nil
}

// DerivedKey is the idempotency key of the i-th message a handler produced for the
// incoming key, when the handler gave it none: "consumer:key:i", or a SHA-256 of it
// in hex when that is not a valid key (too long, or unprintable bytes). It is a
// pure function of the intent, so the same intent always produces the same keys.
func DerivedKey(consumer, key string, i int) string {
	k := fmt.Sprintf("%s:%s:%d", consumer, key, i)
	if _, err := idem.ParseKey(k); err == nil {
		return k
	}
	sum := sha256.Sum256([]byte(k))
	return hex.EncodeToString(sum[:])
}
