package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// writesConn records each write that reaches the network.
type writesConn struct {
	net.Conn
	writes [][]byte
}

func (c *writesConn) Write(p []byte) (int, error) {
	c.writes = append(c.writes, bytes.Clone(p))
	return len(p), nil
}

// amqpFrame is one frame as it goes on the wire.
func amqpFrame(typ byte, channel uint16, payload []byte) []byte {
	f := []byte{typ, byte(channel >> 8), byte(channel)}
	f = binary.BigEndian.AppendUint32(f, uint32(len(payload)))
	f = append(f, payload...)
	return append(f, 0xCE)
}

// TestFrameConnWritesWholeFrames: whatever pieces the stream arrives in,
// every byte goes out once and in order, and a write to the network always
// ends where a frame (or the protocol header) ends.
func TestFrameConnWritesWholeFrames(t *testing.T) {
	stream := []byte(amqpProtocolHeader)
	ends := map[int]bool{len(stream): true}
	for _, size := range []int{0, 1, 6, 7, 100, 4089, 4096, 25 << 10, 3, 70000, 0} {
		stream = append(stream, amqpFrame(3, 7, bytes.Repeat([]byte{byte(size)}, size))...)
		ends[len(stream)] = true
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for round := 0; round < 200; round++ {
		rec := &writesConn{}
		fc := newFrameConn(rec)
		for rest := stream; len(rest) > 0; {
			n := min(len(rest), 1+rng.IntN(9000))
			if round%3 == 0 {
				n = min(len(rest), 1+rng.IntN(8)) // tiny pieces: headers split too
			}
			if k, err := fc.Write(rest[:n]); k != n || err != nil {
				t.Fatalf("Write = %d, %v", k, err)
			}
			rest = rest[n:]
		}
		var sent []byte
		for _, w := range rec.writes {
			sent = append(sent, w...)
			if !ends[len(sent)] {
				t.Fatalf("round %d: a write ended at byte %d, inside a frame", round, len(sent))
			}
		}
		if !bytes.Equal(sent, stream) {
			t.Fatalf("round %d: %d bytes sent, want the %d written, in order", round, len(sent), len(stream))
		}
	}
}

// TestFrameConnOneWritePerPublish: a 25 KB publish written the way
// amqp091-go writes it (method, header and body frames through a 4 KB
// bufio.Writer, then Flush) reaches the network as one write, not three.
func TestFrameConnOneWritePerPublish(t *testing.T) {
	publish := func(conn net.Conn) int {
		rec := conn.(interface{ count() int })
		w := bufio.NewWriterSize(conn, 4096)
		w.Write([]byte(amqpProtocolHeader))
		w.Flush()
		before := rec.count()
		for _, f := range [][]byte{amqpFrame(1, 1, make([]byte, 60)), amqpFrame(2, 1, make([]byte, 300))} {
			w.Write(f)
		}
		body := amqpFrame(3, 1, make([]byte, 25<<10))
		w.Write(body[:7])
		w.Write(body[7 : len(body)-1])
		w.Write(body[len(body)-1:])
		w.Flush()
		return rec.count() - before
	}
	if n := publish(&countingConn{}); n != 3 {
		t.Fatalf("without frameConn the publish took %d writes; the reason for frameConn is gone", n)
	}
	counted := &countingConn{}
	if n := publish(&countedFrameConn{newFrameConn(counted), counted}); n != 1 {
		t.Fatalf("with frameConn the publish took %d writes, want 1", n)
	}
}

type countingConn struct {
	net.Conn
	n int
}

func (c *countingConn) Write(p []byte) (int, error) { c.n++; return len(p), nil }
func (c *countingConn) count() int                  { return c.n }

type countedFrameConn struct {
	*frameConn
	under *countingConn
}

func (c *countedFrameConn) count() int { return c.under.n }

// TestAMQPDialFramesPlainOnly: amqp:// connections get frameConn; amqps://
// ones do not, as TLS goes over what the dialer returns.
func TestAMQPDialFramesPlainOnly(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	for url, framed := range map[string]bool{"amqp://u:p@host/v": true, "amqps://u:p@host/v": false} {
		conn, err := amqpDial(url, time.Second)("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := conn.(*frameConn); ok != framed {
			t.Errorf("%s: frameConn %v, want %v", url, ok, framed)
		}
		conn.Close()
	}
}

// TestAMQPSEndToEnd: a broker behind TLS (amqps://, its CA from cacertfile):
// the webhook is published and both workers store it, over TLS both ways.
func TestAMQPSEndToEnd(t *testing.T) {
	vhost := newVhost(t)
	proxy := newTLSProxy(t, "127.0.0.1:5672")
	cfg := testConfig(t, proxy.URL(vhost))

	// The certificate is checked: without the CA file the broker is not
	// reachable.
	untrusted, _, _ := strings.Cut(proxy.URL(vhost), "?")
	q := NewQueues(cfg.Queue, mustBrokers(t, untrusted), slog.New(slog.DiscardHandler))
	if err := q.Reachable(context.Background(), q.conns[0].broker); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("amqps without the CA: %v, want a certificate error", err)
	}
	q.Close()

	d := startDaemon(t, cfg)

	guid := "amqps-" + randHex(4)
	if code, body := do(t, webhookRequest(t, d.URL, "issues", guid, loadFixture(t, "issues", "opened.payload.json"))); code != http.StatusAccepted {
		t.Fatalf("webhook over amqps: %d %s", code, body)
	}
	storedAll(t, cfg.Database.Path, []string{guid}, 20*time.Second)
}
