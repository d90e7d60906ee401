package main

import (
	"errors"

	gojson "github.com/goccy/go-json"
)

// JSON on the hot path goes through github.com/goccy/go-json, which reads
// it as encoding/json does (FuzzValidJSON and FuzzDecodeJSON hold it to
// that) in one pass, where encoding/json makes two (checkValid, then the
// decode) with a scanner that calls a function per byte, which made JSON
// the largest part of the endpoint's CPU. A one-pass reader of our own did
// the job before; the library does it faster, and is kept by others
// (BENCHMARKS.md has the comparison).

// validJSON reports whether b is one valid JSON value, as json.Valid does:
// the webhook endpoint's check of every payload.
func validJSON(b []byte) bool {
	return gojson.Valid(b)
}

// decodeJSON unmarshals b into v as encoding/json does, checking all of b
// while it decodes only the fields v has, in one pass (DecodeEvent's). A
// value of another type than its field's is a shape error
// (isShapeError); the rest of v is decoded all the same.
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
