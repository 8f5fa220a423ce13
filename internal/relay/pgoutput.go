package relay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
)

// The log relay asks pgoutput for binary tuples (its binary option): the columns
// it reads arrive in their types' send formats, so a payload is its bytes, not
// their hex, and a timestamp is a number, whatever the walsender's DateStyle.

// outboxColumns is where an idem_outbox INSERT's columns are in its tuple, by the
// relation message that describes the table. A relation message comes before the
// first change of a table in a session and again after the table changes shape.
type outboxColumns struct {
	id, key, subject, msgID, headers, payload, created, name, relay int
}

// outboxColumnsOf finds the columns the relay needs in rel, or says which is
// missing (a schema older than the relay's).
func outboxColumnsOf(rel *pglogrepl.RelationMessage) (outboxColumns, error) {
	at := map[string]int{}
	for i, c := range rel.Columns {
		at[c.Name] = i
	}
	var cols outboxColumns
	for _, f := range []struct {
		name string
		to   *int
	}{
		{"id", &cols.id}, {"key", &cols.key}, {"subject", &cols.subject}, {"msg_id", &cols.msgID},
		{"headers", &cols.headers}, {"payload", &cols.payload}, {"created_at", &cols.created},
		{"message_name", &cols.name}, {"relay", &cols.relay},
	} {
		i, ok := at[f.name]
		if !ok {
			return cols, fmt.Errorf("relay: the outbox the slot streams has no column %s (migrate the schema)", f.name)
		}
		*f.to = i
	}
	return cols, nil
}

// loggedRow is an INSERT the slot streamed: the row, and whether it is the log
// relay's (relay = 'log'; the polling relay publishes the others).
type loggedRow struct {
	outboxRow
	mine bool
}

// decodeInsert reads an outbox row out of an INSERT's binary tuple.
func (cols outboxColumns) decodeInsert(t *pglogrepl.TupleData) (loggedRow, error) {
	var r loggedRow
	col := func(i int) (*pglogrepl.TupleDataColumn, error) {
		if i >= len(t.Columns) {
			return nil, fmt.Errorf("relay: the tuple has %d columns, want more than %d", len(t.Columns), i)
		}
		return t.Columns[i], nil
	}
	text := func(i int, nullable bool) (string, error) {
		c, err := col(i)
		switch {
		case err != nil:
			return "", err
		case c.DataType == pglogrepl.TupleDataTypeNull && nullable:
			return "", nil
		case c.DataType != pglogrepl.TupleDataTypeBinary:
			return "", fmt.Errorf("relay: column %d: want a binary value, got %q", i, c.DataType)
		}
		return string(c.Data), nil
	}
	c, err := col(cols.id)
	if err != nil {
		return r, err
	}
	if r.id, err = binaryInt8(c); err != nil {
		return r, fmt.Errorf("relay: id: %w", err)
	}
	relay, err := text(cols.relay, true)
	if err != nil {
		return r, err
	}
	if r.mine = relay == "log"; !r.mine {
		return r, nil
	}
	if r.key, err = text(cols.key, false); err != nil {
		return r, err
	}
	if r.subject, err = text(cols.subject, false); err != nil {
		return r, err
	}
	if r.msgID, err = text(cols.msgID, false); err != nil {
		return r, err
	}
	if r.name, err = text(cols.name, true); err != nil {
		return r, err
	}
	if c, err = col(cols.headers); err != nil {
		return r, err
	}
	if c.DataType != pglogrepl.TupleDataTypeNull {
		// jsonb's binary format is a version byte, 1, then the JSON text.
		if c.DataType != pglogrepl.TupleDataTypeBinary || len(c.Data) == 0 || c.Data[0] != 1 {
			return r, errors.New("relay: headers: not jsonb version 1")
		}
		r.headers = c.Data[1:]
	}
	if c, err = col(cols.payload); err != nil {
		return r, err
	}
	if c.DataType != pglogrepl.TupleDataTypeBinary {
		return r, errors.New("relay: payload: not a binary value")
	}
	r.payload = c.Data
	if c, err = col(cols.created); err != nil {
		return r, err
	}
	if r.created, err = binaryTimestamptz(c); err != nil {
		return r, fmt.Errorf("relay: created_at: %w", err)
	}
	return r, nil
}

func binaryInt8(c *pglogrepl.TupleDataColumn) (int64, error) {
	if c.DataType != pglogrepl.TupleDataTypeBinary || len(c.Data) != 8 {
		return 0, fmt.Errorf("want 8 binary bytes, got %q with %d", c.DataType, len(c.Data))
	}
	return int64(binary.BigEndian.Uint64(c.Data)), nil
}

// postgresEpoch is where a timestamptz's microseconds count from.
var postgresEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

func binaryTimestamptz(c *pglogrepl.TupleDataColumn) (time.Time, error) {
	us, err := binaryInt8(c)
	if err != nil {
		return time.Time{}, err
	}
	return postgresEpoch.Add(time.Duration(us) * time.Microsecond), nil
}
