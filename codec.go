package main

import (
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/klauspost/compress/zstd"
)

// Payloads compressed once, from the door to the disk. GitHub's payloads
// shrink six to ten times with zstd at its fastest level (a 25 KB
// pull_request to a few KB), at a few tens of microseconds each: a
// webhook is compressed once on its way to the broker (Queues.fit), the
// message carries those bytes (content_encoding zstd), and the raw log
// stores them as they came. Every reader of a message also takes gzip
// (what a node publishes over queue.compress_over with queue.compress =
// "none", or an older node) and plain bodies (an outside producer's), and
// inflates none past maxInflated.

// maxInflated bounds what a compressed body or stored payload may inflate
// to: the largest webhook (25 MiB) and room for the wrapped form's
// headers. A body that inflates past it is refused for good, as no retry
// makes it smaller.
const maxInflated = 25<<20 + 1<<20

// The content encodings switchyard writes.
const (
	encodingZstd = "zstd"
	encodingGzip = "gzip"
)

// zstdPair is the one zstd encoder and decoder of the process (zstdCodec).
// Their EncodeAll and DecodeAll are safe for concurrent use, start no
// goroutines, and keep their buffers between calls.
type zstdPair struct {
	enc *zstd.Encoder
	dec *zstd.Decoder
}

var zstdCodec = sync.OnceValue(func() zstdPair {
	// Literals are entropy-coded even in a block without matches, which
	// the fastest level skips by default: a payload carrying a large
	// base64 or hex blob then shrinks by a third to a half rather than not
	// at all (under a broker's 16 MiB limit, that is a 20 MiB webhook
	// taken), at no cost on JSON, whose blocks all have matches.
	enc, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithZeroFrames(true),
		zstd.WithAllLitEntropyCompression(true))
	if err != nil {
		panic(err) // only for options it does not know
	}
	dec, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(0), zstd.WithDecoderMaxMemory(maxInflated),
		zstd.WithDecoderMaxWindow(maxInflated))
	if err != nil {
		panic(err)
	}
	return zstdPair{enc, dec}
})

// compressZstd is b as one zstd frame at the fastest level; an empty b
// is a frame too, so that it reads back as empty.
func compressZstd(b []byte) []byte {
	return zstdCodec().enc.EncodeAll(b, make([]byte, 0, len(b)/4+16))
}

// inflateZstd is b's zstd frames inflated, never past maxInflated.
func inflateZstd(b []byte) ([]byte, error) { return inflateZstdTo(nil, b) }

// inflateZstdTo is inflateZstd into dst's spare capacity when they fit
// there (dst is empty), else into a slice of its own.
func inflateZstdTo(dst, b []byte) ([]byte, error) {
	out, err := zstdCodec().dec.DecodeAll(b, dst)
	if err != nil {
		return nil, fmt.Errorf("zstd: %w", err)
	}
	if len(out) > maxInflated {
		return nil, fmt.Errorf("zstd: inflates past %d bytes", maxInflated)
	}
	return out, nil
}

// inflateRoom is where a consumer's zstd bodies inflate, one after the
// other, emptied for its next batch once a batch is handled: the
// consumers inflate every message they take, and a slice of its own for
// each (25 KB for a typical pull_request) was two fifths of the daemon's
// allocations, and so of its collector's work.
type inflateRoom struct{ buf []byte }

// keptRoom bounds the room a consumer keeps: a batch of typical webhooks
// (a hundred of 25 KB) fits; larger ones inflate into slices of their
// own, as before.
const keptRoom = 4 << 20

// empty readies r for the next batch: what was inflated into it must no
// longer be used.
func (r *inflateRoom) empty() { r.buf = r.buf[:0] }

// body is inflateBody with a zstd body inflated into r, after the bodies
// inflated into it before.
func (r *inflateRoom) body(encoding string, body []byte) ([]byte, error) {
	if encoding != encodingZstd {
		return inflateBody(encoding, body)
	}
	spare := r.buf[len(r.buf):cap(r.buf)]
	out, err := inflateZstdTo(spare[:0], body)
	if err != nil || len(out) == 0 {
		return out, err
	}
	if len(out) <= len(spare) && &out[0] == &spare[0] {
		r.buf = r.buf[:len(r.buf)+len(out)]
		return out[:len(out):len(out)], nil
	}
	// It did not fit, and has a slice of its own: the bodies after it
	// inflate into a larger room, while the one before stays with the
	// bodies in it (no copy).
	if grow := max(2*cap(r.buf), 2*len(out), 256<<10); grow <= keptRoom {
		r.buf = make([]byte, 0, grow)
	}
	return out, nil
}

// compressGzip gzips body at gzip's fastest level: on a small VPS the CPU
// is dearer than the last tenth of the bytes a slower level saves, and
// JSON shrinks several times over at any level.
func compressGzip(body []byte) []byte {
	var buf bytes.Buffer
	buf.Grow(len(body) / 4)
	// A valid level cannot fail, nor can writes to a bytes.Buffer.
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestSpeed)
	_, _ = zw.Write(body)
	_ = zw.Close()
	return buf.Bytes()
}

// inflateBody reads a message body as its content encoding says: plain,
// zstd or gzip, inflated to at most maxInflated bytes. Any other encoding,
// a broken stream, or one that inflates past the bound is an error no
// retry can help.
func inflateBody(encoding string, body []byte) ([]byte, error) {
	switch encoding {
	case "", "identity":
		return body, nil
	case encodingZstd:
		return inflateZstd(body)
	case encodingGzip:
	default:
		return nil, fmt.Errorf("content_encoding %q is not one switchyard reads (zstd, gzip or none)", encoding)
	}
	zr, err := gzip.NewReader(bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("gzip body: %w", err)
	}
	out, err := io.ReadAll(io.LimitReader(zr, maxInflated+1))
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("gzip body: %w", err)
	}
	if len(out) > maxInflated {
		return nil, fmt.Errorf("gzip body inflates past %d bytes", maxInflated)
	}
	return out, nil
}
