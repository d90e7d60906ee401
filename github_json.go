package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"unicode/utf8"
)

// A one-pass JSON reader for the hot path. encoding/json reads a payload
// twice (checkValid, then the decode) with a scanner that calls a function per
// byte; for a 25 KB webhook that was over half of the endpoint's CPU and a
// third of a consumer's (see BENCHMARKS.md). This reader validates exactly as
// json.Valid does (FuzzValidJSON holds it to that) and hands out the
// top-level members of an object as slices of the input, which encoding/json
// then decodes one small value at a time.

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
// order, with the decoded key and the raw value. It returns false, having
// called member for some members perhaps, when b is not one valid JSON
// object.
func jsonMembers(b []byte, member func(key string, value []byte)) bool {
	return jsonRawMembers(b, func(quoted, value []byte) { member(jsonKey(quoted), value) })
}

// jsonRawMembers is jsonMembers with each key as it stands, quoted.
func jsonRawMembers(b []byte, member func(quoted, value []byte)) bool {
	r := jsonReader{b: b}
	r.space()
	if r.i >= len(r.b) || r.b[r.i] != '{' || !r.object(member) {
		return false
	}
	r.space()
	return r.i == len(r.b)
}

// seenMembers is jsonRawMembers for an object this reader has validated
// already, as a member of a payload decodePayload read: a second look, to
// find a field or cut the object down. It finds where each string ends by
// its closing quote alone (bytes.IndexByte) and where each value ends by
// counting brackets, checking nothing in between: a fifth of the decoding of
// a 25 KB pull_request message with its typed row (BENCHMARKS.md).
// On input that is not valid JSON its answer means nothing, but it reads
// nothing out of bounds; never give it bytes from outside unchecked.
func seenMembers(b []byte, member func(quoted, value []byte)) {
	r := jsonReader{b: b}
	r.space()
	if r.i >= len(r.b) || r.b[r.i] != '{' {
		return
	}
	r.i++
	for {
		r.space()
		if r.i >= len(r.b) || r.b[r.i] != '"' {
			return // '}' or broken
		}
		start := r.i
		r.skipString()
		key := r.b[start:r.i]
		r.space()
		if r.i >= len(r.b) || r.b[r.i] != ':' {
			return
		}
		r.i++
		r.space()
		vstart := r.i
		r.skipValue()
		member(key, r.b[vstart:r.i])
		r.space()
		if r.i >= len(r.b) || r.b[r.i] != ',' {
			return
		}
		r.i++
	}
}

// skipString moves past the string that starts at r.i: to the first quote
// after it that an even run of backslashes precedes. A run ends at the
// previous quote, so each byte is counted at most once.
func (r *jsonReader) skipString() {
	for j := r.i + 1; j < len(r.b); {
		k := bytes.IndexByte(r.b[j:], '"')
		if k < 0 {
			break
		}
		q := j + k
		n := 0
		for q-1-n > r.i && r.b[q-1-n] == '\\' {
			n++
		}
		if n%2 == 0 {
			r.i = q + 1
			return
		}
		j = q + 1
	}
	r.i = len(r.b)
}

// skipValue moves past the value that starts at r.i: a string, a container
// (to its closing bracket, strings skipped whole), or a scalar (to the next
// delimiter).
func (r *jsonReader) skipValue() {
	if r.i >= len(r.b) {
		return
	}
	switch r.b[r.i] {
	case '"':
		r.skipString()
		return
	case '{', '[':
	default:
		for r.i < len(r.b) {
			switch r.b[r.i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return
			}
			r.i++
		}
		return
	}
	depth := 0
	for r.i < len(r.b) {
		switch r.b[r.i] {
		case '"':
			r.skipString()
			continue
		case '{', '[':
			depth++
		case '}', ']':
			if depth--; depth == 0 {
				r.i++
				return
			}
		}
		r.i++
	}
}

// jsonField returns the raw value of key in the JSON object obj (the last
// one, as encoding/json takes), or nil when obj is not an object or has no
// such key. obj must have been validated (seenMembers).
func jsonField(obj []byte, key string) []byte {
	if len(obj) == 0 || obj[0] != '{' {
		return nil
	}
	var v []byte
	seenMembers(obj, func(quoted, value []byte) {
		// Most keys are plain: compare them as they stand, without
		// decoding (and allocating) each.
		if len(quoted) == len(key)+2 && string(quoted[1:len(quoted)-1]) == key ||
			bytes.IndexByte(quoted, '\\') >= 0 && jsonKey(quoted) == key {
			v = value
		}
	})
	return v
}

func (r *jsonReader) space() {
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

// jsonKey decodes a quoted key as encoding/json does; keys with escapes or
// bytes that are not UTF-8 (which it turns into U+FFFD) are rare and go the
// slow way.
func jsonKey(quoted []byte) string {
	if bytes.IndexByte(quoted, '\\') < 0 && utf8.Valid(quoted) {
		return string(quoted[1 : len(quoted)-1])
	}
	var s string
	_ = json.Unmarshal(quoted, &s)
	return s
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
		// A byte of the word is zero, or below 0x20, exactly when the word's test
		// sets its high bit (the classic "has zero byte" / "has less" tricks).
		special := (quote-ones)&^quote | (backslash-ones)&^backslash | (w-ones*0x20)&^w
		if special&highs != 0 {
			break
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
