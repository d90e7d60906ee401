package main

import (
	"errors"
	"fmt"
)

// The raw log's payloads, compressed (codec.go). A row keeps its payload
// compressed in payload_zstd, and payload empty: the bytes its message
// came as when it came zstd-compressed, else compressed when stored. A row
// written before (payload_zstd NULL) keeps it as text until the retention
// job compresses it (CompressOlderPayloads). Every reader gives the exact
// bytes back (rowPayload).

// ErrPayloadUnreadable is a stored payload that does not inflate: the
// row is reported, never a crash.
var ErrPayloadUnreadable = errors.New("stored payload does not decompress")

// rowPayload is a row's payload, from its two columns: inflated when it
// is stored compressed, else the text it was stored as (a row from before,
// or one pruned).
func rowPayload(text string, compressed []byte) ([]byte, error) {
	if compressed == nil {
		return []byte(text), nil
	}
	out, err := inflateZstd(compressed)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrPayloadUnreadable, err)
	}
	return out, nil
}

// packedPayload is ev's payload as the raw log stores it: the bytes its
// message came as, when it came zstd-compressed, else compressed now.
func packedPayload(ev *Event) []byte {
	if ev.PayloadZstd != nil {
		return ev.PayloadZstd
	}
	return compressZstd(ev.Payload)
}
