package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"math/bits"
	"unicode/utf8"

	gojson "github.com/goccy/go-json"
)

// A one-pass JSON reader for the hot path. encoding/json reads a payload
// twice (checkValid, then the decode) with a scanner that calls a function per
// byte; for a 25 KB webhook that was over half of the endpoint's CPU and a
// third of a consumer's (see BENCHMARKS.md). This reader validates exactly as
// json.Valid does (FuzzValidJSON holds it to that) and hands out the
// top-level members of an object as slices of the input; in the same pass it
// cuts a payload down to the few fields the workers read (jsonCut), which
// decodeJSON then decodes.

// maxJSONDepth is encoding/json's own nesting limit.
const maxJSONDepth = 10000

type jsonReader struct {
	b     []byte
	i     int
	depth int
	out   *bytes.Buffer // jsonCut's: where object writes what it keeps
	// escaped tells that the last string str read had an escape in it.
	escaped bool
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
	if r.i >= len(r.b) || r.b[r.i] != '{' || !r.object(member, nil) {
		return false
	}
	r.space()
	return r.i == len(r.b)
}

// jsonCut is jsonRawMembers that also writes to out, in the same pass, the
// object cut down to keep: a tree of member names, each nil to keep the
// member whole or a subtree to cut its value (when that is an object) the
// same way. Members are written in the order they come, duplicates
// included, so a decoder that takes the last of a key (encoding/json does)
// reads the same value in the cut as in the whole. On false (b is not one
// valid JSON object) out holds nothing useful.
func jsonCut(b []byte, keep map[string]any, out *bytes.Buffer, member func(quoted, value []byte)) bool {
	r := jsonReader{b: b, out: out}
	r.space()
	if r.i >= len(r.b) || r.b[r.i] != '{' || !r.object(member, keep) {
		return false
	}
	r.space()
	return r.i == len(r.b)
}

// kept looks up a member's quoted key in keep. A key without escapes is
// looked up as it stands (every key GitHub sends is): encoding/json would
// read it the same, or, where its bytes are not UTF-8, as a key with U+FFFD
// in it, which no tree holds. A key with escapes is decoded as encoding/json
// would, and written back re-encoded.
func kept(keep map[string]any, quoted []byte, escaped bool) (sub any, ok bool, key []byte) {
	if !escaped {
		sub, ok = keep[string(quoted[1:len(quoted)-1])]
		return sub, ok, quoted
	}
	k := jsonKey(quoted)
	if sub, ok = keep[k]; ok {
		key, _ = json.Marshal(k)
	}
	return sub, ok, key
}

// decodeJSON unmarshals b into v as encoding/json does, with
// github.com/goccy/go-json's decoder: on a pull request's cut (490 bytes, two
// dozen fields) encoding/json took 11-13 us of a consumer's CPU per message
// and this one 2 (BENCHMARKS.md). FuzzDecodeJSON holds the two to the same
// answers; the payloads it reads are cuts, which jsonCut has checked.
func decodeJSON(b []byte, v any) error {
	return gojson.Unmarshal(b, v)
}

// jsonField returns the raw value of key in the JSON object obj (the last
// one, as encoding/json takes), or nil when obj is not an object or has no
// such key. It reads all of obj: give it small objects (a cut's members).
func jsonField(obj []byte, key string) []byte {
	if len(obj) == 0 || obj[0] != '{' {
		return nil
	}
	var v []byte
	jsonMembers(obj, func(k string, value []byte) {
		if k == key {
			v = value
		}
	})
	return v
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
		return r.object(nil, nil)
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
// its members. With keep set (jsonCut), it also writes to r.out the object
// cut down to keep.
func (r *jsonReader) object(member func(quoted, value []byte), keep map[string]any) bool {
	if r.depth++; r.depth > maxJSONDepth {
		return false
	}
	defer func() { r.depth-- }()
	if keep != nil {
		r.out.WriteByte('{')
	}
	written := false
	r.i++ // {
	r.space()
	if r.i < len(r.b) && r.b[r.i] == '}' {
		r.i++
		if keep != nil {
			r.out.WriteByte('}')
		}
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
		key, escaped := r.b[start:r.i], r.escaped
		r.space()
		if r.i >= len(r.b) || r.b[r.i] != ':' {
			return false
		}
		r.i++
		r.space()
		vstart := r.i
		if keep == nil {
			if !r.value() {
				return false
			}
		} else if sub, ok, quoted := kept(keep, key, escaped); !ok {
			if !r.value() {
				return false
			}
		} else {
			if written {
				r.out.WriteByte(',')
			}
			written = true
			r.out.Write(quoted)
			r.out.WriteByte(':')
			if nested, _ := sub.(map[string]any); nested != nil && r.i < len(r.b) && r.b[r.i] == '{' {
				if !r.object(nil, nested) {
					return false
				}
			} else {
				if !r.value() {
					return false
				}
				r.out.Write(r.b[vstart:r.i])
			}
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
			if keep != nil {
				r.out.WriteByte('}')
			}
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
	r.escaped = false
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
			r.escaped = true
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
