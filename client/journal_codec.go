package client

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"

	"github.com/idemkit/idem"
)

// The journal file format.
//
// A journal is an 8-byte file header (magic) followed by frames, appended and never
// rewritten in place:
//
//	frame   = crc32c(u32 LE) | length(u32 LE) | payload[length]
//	payload = kind(u8) | fields...
//
// The checksum covers the length and the payload, so a torn length is caught as
// surely as a torn payload. Fields are fixed-width little-endian integers and
// u32-length-prefixed byte strings: one value has exactly one encoding, so whatever
// decodes re-encodes to the same bytes (FuzzJournalDecode checks it).
//
//	intent  (1): key, scope, method, path (strings), created_at (i64 unix ns),
//	             attempts (u32), payload (bytes)
//	attempt (2): key, at (i64)
//	done    (3): key, at (i64), status (u8: 1 done, 2 rejected), http_status (u16),
//	             response (bytes)
//	forget  (4): key, at (i64)
const (
	magic       = "IDEMJNL\x01"
	frameHeader = 8
	// maxRecord bounds one record. It keeps a corrupt length field from making
	// OpenJournal allocate gigabytes, and bounds the payload an intent may carry.
	maxRecord = 64 << 20
)

type recordKind uint8

const (
	kindIntent  recordKind = 1
	kindAttempt recordKind = 2
	kindDone    recordKind = 3
	kindForget  recordKind = 4
)

// The final statuses as stored in a done record.
const (
	doneOK       uint8 = 1
	doneRejected uint8 = 2
)

// crcTable is CRC-32C (Castagnoli): hardware accelerated on amd64 and arm64 and
// better at catching burst errors than the IEEE polynomial.
var crcTable = crc32.MakeTable(crc32.Castagnoli)

// record is one decoded record. Which fields are meaningful depends on Kind.
type record struct {
	Kind       recordKind
	Key        idem.Key
	Scope      string // intent
	Method     string // intent
	Path       string // intent
	CreatedAt  int64  // intent: unix nanoseconds
	Attempts   uint32 // intent: attempts folded in by compaction
	Payload    []byte // intent
	At         int64  // attempt, done, forget: unix nanoseconds
	Status     uint8  // done
	HTTPStatus uint16 // done
	Response   []byte // done
}

// encodeFrame encodes rec as a framed record: checksum, length, payload.
func encodeFrame(rec record) []byte {
	payload := encodeRecord(rec)
	frame := make([]byte, frameHeader, frameHeader+len(payload))
	binary.LittleEndian.PutUint32(frame[4:8], uint32(len(payload)))
	frame = append(frame, payload...)
	binary.LittleEndian.PutUint32(frame[0:4], crc32.Checksum(frame[4:], crcTable))
	return frame
}

// decodeFrame decodes the frame at the start of b and returns the record and the
// frame's length. Any error means "no intact record here": too short, a length out
// of bounds, a checksum mismatch or a payload that does not decode.
func decodeFrame(b []byte) (record, int, error) {
	if len(b) < frameHeader {
		return record{}, 0, fmt.Errorf("short frame header: %d bytes", len(b))
	}
	n := binary.LittleEndian.Uint32(b[4:8])
	if n == 0 || n > maxRecord {
		return record{}, 0, fmt.Errorf("frame length %d out of range", n)
	}
	if uint64(len(b)-frameHeader) < uint64(n) {
		return record{}, 0, fmt.Errorf("frame of %d bytes cut off after %d", n, len(b)-frameHeader)
	}
	end := frameHeader + int(n)
	if got, want := crc32.Checksum(b[4:end], crcTable), binary.LittleEndian.Uint32(b[0:4]); got != want {
		return record{}, 0, fmt.Errorf("checksum mismatch: %08x != %08x", got, want)
	}
	rec, err := decodeRecord(b[frameHeader:end])
	if err != nil {
		return record{}, 0, err
	}
	return rec, end, nil
}

// encodeRecord encodes a record's payload (no frame).
func encodeRecord(rec record) []byte {
	var e encoder
	e.u8(uint8(rec.Kind))
	e.bytes([]byte(rec.Key))
	switch rec.Kind {
	case kindIntent:
		e.bytes([]byte(rec.Scope))
		e.bytes([]byte(rec.Method))
		e.bytes([]byte(rec.Path))
		e.i64(rec.CreatedAt)
		e.u32(rec.Attempts)
		e.bytes(rec.Payload)
	case kindAttempt, kindForget:
		e.i64(rec.At)
	case kindDone:
		e.i64(rec.At)
		e.u8(rec.Status)
		e.u16(rec.HTTPStatus)
		e.bytes(rec.Response)
	}
	return e.b
}

// decodeRecord decodes a record's payload. It is strict: unknown kinds or statuses,
// invalid keys and trailing bytes are errors, so every payload it accepts has
// exactly one encoding.
func decodeRecord(b []byte) (record, error) {
	d := decoder{b: b}
	var rec record
	rec.Kind = recordKind(d.u8())
	key := d.bytes()
	switch rec.Kind {
	case kindIntent:
		rec.Scope = string(d.bytes())
		rec.Method = string(d.bytes())
		rec.Path = string(d.bytes())
		rec.CreatedAt = d.i64()
		rec.Attempts = d.u32()
		rec.Payload = d.bytes()
	case kindAttempt, kindForget:
		rec.At = d.i64()
	case kindDone:
		rec.At = d.i64()
		rec.Status = d.u8()
		rec.HTTPStatus = d.u16()
		rec.Response = d.bytes()
	default:
		if d.err == nil {
			return record{}, fmt.Errorf("unknown record kind %d", rec.Kind)
		}
	}
	if d.err != nil {
		return record{}, d.err
	}
	if len(d.b) != 0 {
		return record{}, fmt.Errorf("%d trailing bytes after record", len(d.b))
	}
	k, err := idem.ParseKey(string(key))
	if err != nil {
		return record{}, err
	}
	rec.Key = k
	if err := idem.ValidateScope(rec.Scope); err != nil {
		return record{}, err
	}
	if rec.Kind == kindDone && rec.Status != doneOK && rec.Status != doneRejected {
		return record{}, fmt.Errorf("unknown done status %d", rec.Status)
	}
	return rec, nil
}

type encoder struct{ b []byte }

func (e *encoder) u8(v uint8)   { e.b = append(e.b, v) }
func (e *encoder) u16(v uint16) { e.b = binary.LittleEndian.AppendUint16(e.b, v) }
func (e *encoder) u32(v uint32) { e.b = binary.LittleEndian.AppendUint32(e.b, v) }
func (e *encoder) i64(v int64)  { e.b = binary.LittleEndian.AppendUint64(e.b, uint64(v)) }
func (e *encoder) bytes(v []byte) {
	e.u32(uint32(len(v)))
	e.b = append(e.b, v...)
}

// decoder reads fields off b; the first short read sets err and every later read
// returns zero, so decoding code reads straight through and checks once.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if n < 0 || len(d.b) < n {
		d.err = fmt.Errorf("record cut off: want %d bytes, have %d", n, len(d.b))
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

func (d *decoder) u8() uint8 {
	if v := d.take(1); v != nil {
		return v[0]
	}
	return 0
}

func (d *decoder) u16() uint16 {
	if v := d.take(2); v != nil {
		return binary.LittleEndian.Uint16(v)
	}
	return 0
}

func (d *decoder) u32() uint32 {
	if v := d.take(4); v != nil {
		return binary.LittleEndian.Uint32(v)
	}
	return 0
}

func (d *decoder) i64() int64 {
	if v := d.take(8); v != nil {
		return int64(binary.LittleEndian.Uint64(v))
	}
	return 0
}

func (d *decoder) bytes() []byte {
	n := d.u32()
	if d.err != nil {
		return nil
	}
	if uint64(n) > uint64(len(d.b)) {
		d.err = fmt.Errorf("field of %d bytes cut off after %d", n, len(d.b))
		return nil
	}
	return bytes.Clone(d.take(int(n)))
}
