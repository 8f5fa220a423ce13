package refapp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/consumer"
)

// Charge is the payload of idem.payments.charge: the body of POST /v1/payments.
type Charge struct {
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
}

// Validate is the one rule for a charge, applied by the ingress (400) and by the
// consumer (a dead letter): what the ingress accepts, the consumer can process.
func (c Charge) Validate() error {
	if err := checkText("account", c.Account); err != nil {
		return err
	}
	switch {
	case strings.TrimSpace(c.Account) == "":
		return errors.New(`"account" is required`)
	case c.AmountCents <= 0:
		return fmt.Errorf(`"amount_cents" must be a positive integer, got %d`, c.AmountCents)
	}
	return nil
}

// textError is a payload field that a Postgres text column cannot hold: a NUL
// character, or bytes that are not UTF-8. No retry can store it, so the ingress
// refuses it (400 invalid_text) and a consumer dead-letters it.
type textError struct {
	field, problem string
}

func (e *textError) Error() string {
	return fmt.Sprintf("%q %s, which this service cannot store: send text without it", e.field, e.problem)
}

// checkText is the rule for every text field of a payload: valid UTF-8, no NUL.
func checkText(field, s string) error {
	if i := strings.IndexByte(s, 0); i >= 0 {
		return &textError{field, fmt.Sprintf("holds a NUL character (U+0000) at byte %d", i)}
	}
	if !utf8.ValidString(s) {
		return &textError{field, "is not valid UTF-8"}
	}
	return nil
}

// DecodeCharge parses and validates a charge payload.
func DecodeCharge(payload []byte) (Charge, error) {
	var c Charge
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return c, fmt.Errorf("charge: decode: %w", err)
	}
	if err := c.Validate(); err != nil {
		return c, fmt.Errorf("charge: %w", err)
	}
	return c, nil
}

// ChargeHandler writes one ledger_entries row per charge, inside the inbox
// transaction: the charge is exactly once by construction. It handles a whole batch
// with one INSERT.
type ChargeHandler struct{}

var _ consumer.BatchHandler = ChargeHandler{}

const sqlInsertLedger = `
INSERT INTO ledger_entries (idempotency_key, account, amount_cents)
SELECT k, a, c FROM unnest($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY AS t(k, a, c, n)
ORDER BY n`

// HandleBatch implements consumer.BatchHandler. Its results are nil: nothing reads a
// charge's stored result (a duplicate is acked, not answered).
func (ChargeHandler) HandleBatch(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([][]byte, error) {
	keys := make([]string, len(ds))
	accounts := make([]string, len(ds))
	amounts := make([]int64, len(ds))
	for i, d := range ds {
		c, err := DecodeCharge(d.Payload)
		if err != nil {
			// No retry fixes a payload that does not decode: dead-letter it.
			return nil, consumer.BatchError(i, consumer.Permanent(err))
		}
		keys[i], accounts[i], amounts[i] = d.Key, c.Account, c.AmountCents
	}
	if _, err := tx.Exec(ctx, sqlInsertLedger, keys, accounts, amounts); err != nil {
		return nil, fmt.Errorf("charge: insert ledger entries: %w", err)
	}
	return make([][]byte, len(ds)), nil
}
