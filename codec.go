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

// inflateRoom is where a batch's zstd bodies inflate, one after the
// other: the consumers inflate every message they take, and a slice of
// its own for each (25 KB for a typical pull_request) was two fifths of
// the daemon's allocations, and so of its collector's work. A room is
// sized for its batch when taken and kept for the next batch only until
// the collector takes it (a sync.Pool): under memory pressure, when the
// collector runs often, no room is held between batches.
type inflateRoom struct{ buf []byte }

// keptRoom bounds a room: a batch of typical webhooks (a hundred of 25
// KB) fits; past it, bodies inflate into slices of their own.
const keptRoom = 4 << 20

var inflateRooms = sync.Pool{New: func() any { return new(inflateRoom) }}

// takeInflateRoom is a room with space for need bytes (at most keptRoom).
func takeInflateRoom(need int) *inflateRoom {
	r := inflateRooms.Get().(*inflateRoom)
	if need = min(need, keptRoom); cap(r.buf) < need {
		r.buf = make([]byte, 0, need)
	}
	return r
}

// giveBack returns r for another batch: what was inflated into it must no
// longer be used.
func (r *inflateRoom) giveBack() {
	r.buf = r.buf[:0]
	inflateRooms.Put(r)
}

// inflatedSize is what a body inflates to as its zstd frame's header
// says, 0 when it does not say or says more than maxInflated: what a room
// is sized by.
func inflatedSize(encoding string, body []byte) int {
	var h zstd.Header
	if encoding != encodingZstd || h.Decode(body) != nil || !h.HasFCS || h.FrameContentSize > maxInflated {
		return 0
	}
	return int(h.FrameContentSize)
}

// body is inflateBody with a zstd body inflated into r, after the bodies
// inflated into it before, when it fits there; else into a slice of its
// own.
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
