package main

import (
	"errors"
	"fmt"

	"github.com/klauspost/compress/zstd"
)

// The raw log's payloads, compressed. GitHub's payloads compress six to
// ten times with zstd at its fastest level (a 25 KB pull_request to a few
// KB), at a few tens of microseconds each: the raw log takes a fraction of
// the disk, and a stored row a page or two of SQLite's WAL instead of
// seven. A row keeps its payload compressed in payload_zstd, and payload
// empty; a row written before (payload_zstd NULL) keeps it as text until
// the retention job compresses it (CompressOlderPayloads). Every reader
// gives the exact bytes back (Payload).

// maxPayloadBytes bounds a payload given back: GitHub's own cap on a
// webhook (25 MiB) and a margin. A stored payload that would inflate past
// it is broken, and reported as such.
const maxPayloadBytes = maxWebhookBody + 1<<20

// payloadCodec compresses and inflates payloads; both are safe for
// concurrent use, and hold their buffers between calls.
type payloadCodec struct {
	enc *zstd.Encoder
	dec *zstd.Decoder
}

func newPayloadCodec() *payloadCodec {
	// Two at once: the service and cleanup workers write payloads.
	enc, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithEncoderConcurrency(2),
		zstd.WithZeroFrames(true))
	if err != nil {
		panic(err) // only for options it does not know
	}
	dec, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(2), zstd.WithDecoderMaxMemory(maxPayloadBytes),
		zstd.WithDecoderMaxWindow(maxPayloadBytes))
	if err != nil {
		panic(err)
	}
	return &payloadCodec{enc: enc, dec: dec}
}

// compress is payload as stored.
func (c *payloadCodec) compress(payload []byte) []byte {
	return c.enc.EncodeAll(payload, make([]byte, 0, len(payload)/4))
}

// ErrPayloadUnreadable is a stored payload that does not inflate: the
// row is reported, never a crash.
var ErrPayloadUnreadable = errors.New("stored payload does not decompress")

// payload is a row's payload, from its two columns: inflated when it is
// stored compressed, else the text it was stored as (a row from before,
// or one pruned).
func (c *payloadCodec) payload(text string, compressed []byte) ([]byte, error) {
	if compressed == nil {
		return []byte(text), nil
	}
	out, err := c.dec.DecodeAll(compressed, nil)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrPayloadUnreadable, err)
	}
	if len(out) > maxPayloadBytes {
		return nil, fmt.Errorf("%w: over %d bytes", ErrPayloadUnreadable, maxPayloadBytes)
	}
	return out, nil
}

// close lets the codec's goroutines go.
func (c *payloadCodec) close() {
	c.enc.Close()
	c.dec.Close()
}
