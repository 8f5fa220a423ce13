package ops

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"
)

// Bytes is a bytea column shown to people and to JSON: as text when it is UTF-8
// (payloads and responses are JSON bodies), otherwise as "base64:" and the
// base64 encoding. Text that itself starts with "base64:" is encoded too, so the
// form is never ambiguous and UnmarshalJSON restores the exact bytes.
type Bytes []byte

const base64Prefix = "base64:"

// String returns the text, or "base64:..." for binary data.
func (b Bytes) String() string {
	if utf8.Valid(b) && !strings.HasPrefix(string(b), base64Prefix) {
		return string(b)
	}
	return base64Prefix + base64.StdEncoding.EncodeToString(b)
}

// MarshalJSON implements json.Marshaler.
func (b Bytes) MarshalJSON() ([]byte, error) {
	if b == nil {
		return []byte("null"), nil
	}
	return json.Marshal(b.String())
}

// UnmarshalJSON implements json.Unmarshaler, reversing MarshalJSON.
func (b *Bytes) UnmarshalJSON(data []byte) error {
	if string(data) == "null" {
		*b = nil
		return nil
	}
	var s string
	if err := json.Unmarshal(data, &s); err != nil {
		return err
	}
	enc, ok := strings.CutPrefix(s, base64Prefix)
	if !ok {
		*b = Bytes(s)
		return nil
	}
	raw, err := base64.StdEncoding.DecodeString(enc)
	if err != nil {
		return fmt.Errorf("ops: %w", err)
	}
	*b = raw
	return nil
}
