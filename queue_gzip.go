package main

import (
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
)

// Large bodies travel gzip-compressed: GitHub sends payloads up to 25 MB,
// RabbitMQ 4 takes messages up to 16 MiB by default, and a free plan's
// link is slow. JSON shrinks several times over, so a body over
// queue.compress_over is published with content_encoding gzip, and every
// reader inflates it again, never past maxInflated.

// maxInflated bounds what a compressed message may inflate to: the largest
// webhook body, and room for the wrapped form's headers. A message that
// inflates past it is refused for good, as no retry makes it smaller.
const maxInflated = 25<<20 + 64<<10

// encodingGzip is the content_encoding of a compressed body.
const encodingGzip = "gzip"

// TooLargeError is a message still over the broker's max_message_bytes,
// compressed where compression was on. Its text names no broker.
type TooLargeError struct {
	Size, Max int64
}

func (e *TooLargeError) Error() string {
	return fmt.Sprintf("message of %d bytes is over the broker's max_message_bytes (%d)", e.Size, e.Max)
}

// compressBody gzips body at gzip's fastest level: on a small VPS the CPU
// is dearer than the last tenth of the bytes a slower level saves, and
// JSON shrinks several times over at any level.
func compressBody(body []byte) []byte {
	var buf bytes.Buffer
	buf.Grow(len(body) / 4)
	// A valid level cannot fail, nor can writes to a bytes.Buffer.
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestSpeed)
	_, _ = zw.Write(body)
	_ = zw.Close()
	return buf.Bytes()
}

// inflateBody reads a message body as its content encoding says: plain,
// or gzip inflated to at most maxInflated bytes. Any other encoding, a
// broken gzip stream, or one that inflates past the bound is an error no
// retry can help.
func inflateBody(encoding string, body []byte) ([]byte, error) {
	switch encoding {
	case "", "identity":
		return body, nil
	case encodingGzip:
	default:
		return nil, fmt.Errorf("content_encoding %q is not one switchyard reads (gzip or none)", encoding)
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
