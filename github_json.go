package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/bits"

	gojson "github.com/goccy/go-json"
)

// A one-pass JSON validator for the webhook endpoint. encoding/json reads a
// payload twice (checkValid, then the decode) with a scanner that calls a
// function per byte; for a 25 KB webhook that was over half of the
// endpoint's CPU (see BENCHMARKS.md). This reader validates exactly as
// json.Valid does (FuzzValidJSON holds it to that) and hands out the
// top-level members of an object as slices of the input. The workers decode
// payloads with decodeJSON.

// maxJSONDepth is encoding/json's own nesting limit.
const maxJSONDepth = 10000

type jsonReader struct {
	b     []byte
	i     int
	depth int
}

// validJSON reports whether b is one valid JSON value, as json.Valid does.
func validJSON(b []byte) bool {
	r := jsonReader{b: b}
	r.space()
	if !r.value() {
		return false
	}
	r.space()
	return r.i == len(r.b)
}

// jsonMembers calls member for each top-level member of the object in b, in
// order, with its key as it stands (quoted) and its raw value. It returns
// false, having called member for some members perhaps, when b is not one
// valid JSON object.
func jsonMembers(b []byte, member func(quoted, value []byte)) bool {
	r := jsonReader{b: b}
	r.space()
	if r.i >= len(r.b) || r.b[r.i] != '{' || !r.object(member) {
		return false
	}
	r.space()
	return r.i == len(r.b)
}

// decodeJSON unmarshals b into v as encoding/json does, with
// github.com/goccy/go-json's decoder, which checks all of b as encoding/json
// does while it decodes only the fields v has. DecodeEvent's one pass over a
// 25 KB pull_request payload with its typed fields takes 20-26 us here,
// against 44-67 for this file's validating cut and encoding/json over the
// cut (BENCHMARKS.md). FuzzDecodeJSON holds it to encoding/json's answers,
// refusals included.
func decodeJSON(b []byte, v any) error {
	return gojson.Unmarshal(b, v)
}

// isShapeError reports whether err, from decodeJSON, is a value of another
// type than its field's (a number where a string belongs), in JSON that is
// valid; any other error is JSON that is not.
func isShapeError(err error) bool {
	var te *gojson.UnmarshalTypeError
	return errors.As(err, &te)
}

func (r *jsonReader) space() {
	if r.i < len(r.b) && r.b[r.i] > ' ' {
		return // compact JSON: no space at all
	}
	for r.i < len(r.b) {
		switch r.b[r.i] {
		case ' ', '\t', '\n', '\r':
			r.i++
		default:
			return
		}
	}
}

func (r *jsonReader) value() bool {
	if r.i >= len(r.b) {
		return false
	}
	switch c := r.b[r.i]; {
	case c == '{':
		return r.object(nil)
	case c == '[':
		return r.array()
	case c == '"':
		return r.str()
	case c == 't':
		return r.literal("true")
	case c == 'f':
		return r.literal("false")
	case c == 'n':
		return r.literal("null")
	case c == '-' || (c >= '0' && c <= '9'):
		return r.number()
	}
	return false
}

// object reads the object at r.i, calling member (when set) with each of
// its members.
func (r *jsonReader) object(member func(quoted, value []byte)) bool {
	if r.depth++; r.depth > maxJSONDepth {
		return false
	}
	defer func() { r.depth-- }()
	r.i++ // {
	r.space()
	if r.i < len(r.b) && r.b[r.i] == '}' {
		r.i++
		return true
	}
	for {
		if r.i >= len(r.b) || r.b[r.i] != '"' {
			return false
		}
		start := r.i
		if !r.str() {
			return false
		}
		key := r.b[start:r.i]
		r.space()
		if r.i >= len(r.b) || r.b[r.i] != ':' {
			return false
		}
		r.i++
		r.space()
		vstart := r.i
		if !r.value() {
			return false
		}
		if member != nil {
			member(key, r.b[vstart:r.i])
		}
		r.space()
		if r.i >= len(r.b) {
			return false
		}
		switch r.b[r.i] {
		case ',':
			r.i++
			r.space()
		case '}':
			r.i++
			return true
		default:
			return false
		}
	}
}

func (r *jsonReader) array() bool {
	if r.depth++; r.depth > maxJSONDepth {
		return false
	}
	defer func() { r.depth-- }()
	r.i++ // [
	r.space()
	if r.i < len(r.b) && r.b[r.i] == ']' {
		r.i++
		return true
	}
	for {
		if !r.value() {
			return false
		}
		r.space()
		if r.i >= len(r.b) {
			return false
		}
		switch r.b[r.i] {
		case ',':
			r.i++
			r.space()
		case ']':
			r.i++
			return true
		default:
			return false
		}
	}
}

func (r *jsonReader) str() bool {
	r.i++ // "
	for r.i < len(r.b) {
		r.i += plainRun(r.b[r.i:])
		if r.i >= len(r.b) {
			break
		}
		c := r.b[r.i]
		switch {
		case c == '"':
			r.i++
			return true
		case c == '\\':
			r.i++
			if r.i >= len(r.b) {
				return false
			}
			switch r.b[r.i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				r.i++
			case 'u':
				if r.i+4 >= len(r.b) {
					return false
				}
				for _, h := range r.b[r.i+1 : r.i+5] {
					if !isHex(h) {
						return false
					}
				}
				r.i += 5
			default:
				return false
			}
		case c < 0x20:
			return false
		default:
			r.i++
		}
	}
	return false
}

// plainRun is how many leading bytes of b need no look inside a string: no
// quote, no backslash, no control character. It tests eight bytes at a time
// (payloads are mostly long strings), then finishes byte by byte.
func plainRun(b []byte) int {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	i := 0
	for ; i+8 <= len(b); i += 8 {
		w := binary.LittleEndian.Uint64(b[i:])
		quote, backslash := w^(ones*'"'), w^(ones*'\\')
		// The classic "has zero byte" / "has less than" tricks: each test
		// sets the high bit of the first byte of the word that is zero (a
		// quote, a backslash) or below 0x20, and may set it wrongly only
		// above such a byte, so the lowest bit set is the first special byte.
		special := ((quote-ones)&^quote | (backslash-ones)&^backslash | (w-ones*0x20)&^w) & highs
		if special != 0 {
			return i + bits.TrailingZeros64(special)/8
		}
	}
	for ; i < len(b); i++ {
		if c := b[i]; c == '"' || c == '\\' || c < 0x20 {
			break
		}
	}
	return i
}

func isHex(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

func (r *jsonReader) literal(lit string) bool {
	if !bytes.HasPrefix(r.b[r.i:], []byte(lit)) {
		return false
	}
	r.i += len(lit)
	return true
}

func (r *jsonReader) number() bool {
	if r.b[r.i] == '-' {
		r.i++
	}
	if r.i >= len(r.b) {
		return false
	}
	switch {
	case r.b[r.i] == '0':
		r.i++
	case r.b[r.i] >= '1' && r.b[r.i] <= '9':
		r.digits()
	default:
		return false
	}
	if r.i < len(r.b) && r.b[r.i] == '.' {
		r.i++
		if r.digits() == 0 {
			return false
		}
	}
	if r.i < len(r.b) && (r.b[r.i] == 'e' || r.b[r.i] == 'E') {
		r.i++
		if r.i < len(r.b) && (r.b[r.i] == '+' || r.b[r.i] == '-') {
			r.i++
		}
		if r.digits() == 0 {
			return false
		}
	}
	return true
}

func (r *jsonReader) digits() int {
	start := r.i
	for r.i < len(r.b) && r.b[r.i] >= '0' && r.b[r.i] <= '9' {
		r.i++
	}
	return r.i - start
}
