package main

// The tests' and the bench's stand-in for the network between switchyard
// and a broker or database: a TCP proxy that can stall, cut and close, end
// TLS, count what passes, and, as the bench's WAN link, delay each
// direction and share a bandwidth (bench_link_test.go).

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"encoding/pem"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// tcpProxy forwards 127.0.0.1:random to target, and can stall (stop
// forwarding while keeping connections open) or close (drop everything and
// refuse new connections).
type tcpProxy struct {
	t      testing.TB
	target string
	ln     net.Listener
	addr   string

	mu      sync.Mutex
	conns   []net.Conn
	stalled bool
	// repliesStalled stops the broker's side only: what the client sends
	// arrives, its answers (confirms) do not.
	repliesStalled bool
	closed         bool
	tls            *tls.Config // set: the proxy ends TLS (newTLSProxy)
	caFile         string
	delay          time.Duration // set: each direction is this late (newWANProxy)
	// links, when set, are the link's two directions, from the client
	// and to it, of a bandwidth (newWANLink).
	links  [2]*wanLink
	frames *frameCounts  // set: the AMQP methods a plan's quota counts, counted as they pass
	trips  *atomic.Int64 // set: a PostgreSQL client's round trips, counted as they pass
	// dropOver, when set, drops a connection once its client has sent
	// more than this many bytes: a broker that closes the connection on a
	// message over its size limit.
	dropOver int64
	// moved counts the bytes forwarded either way (the TLS proxy's: as
	// plain AMQP): what the link carries.
	moved atomic.Int64
}

// frameCounts are the billable AMQP methods a proxy saw: basic.publish from
// the client, basic.deliver and basic.get-ok from the broker.
type frameCounts struct{ publish, deliver, getOK atomic.Int64 }

// countFrames makes the proxy count the billable methods that pass it.
func (p *tcpProxy) countFrames() *frameCounts {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.frames = &frameCounts{}
	return p.frames
}

// countRoundTrips makes the proxy, in front of PostgreSQL, count the
// round trips its clients ask for: each Sync (the extended protocol's end
// of a request, which the server answers) and each simple Query.
func (p *tcpProxy) countRoundTrips() *atomic.Int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.trips = &atomic.Int64{}
	return p.trips
}

// pgScanner follows the messages a PostgreSQL client sends (a startup
// message without a type byte, then a type byte and a length each) and
// counts the round trips among them.
type pgScanner struct {
	trips   *atomic.Int64
	started bool
	hdr     [5]byte
	hn      int
	left    int // the message's bytes still to pass
}

func (s *pgScanner) feed(b []byte) {
	for len(b) > 0 {
		if s.left > 0 {
			n := min(s.left, len(b))
			s.left, b = s.left-n, b[n:]
			continue
		}
		hdr := s.hdr[:5]
		if !s.started {
			hdr = s.hdr[:4]
		}
		n := copy(hdr[s.hn:], b)
		s.hn, b = s.hn+n, b[n:]
		if s.hn < len(hdr) {
			return
		}
		s.hn, s.left = 0, int(binary.BigEndian.Uint32(hdr[len(hdr)-4:]))-4
		if s.started && (hdr[0] == 'S' || hdr[0] == 'Q') {
			s.trips.Add(1)
		}
		s.started = true
	}
}

// frameScanner follows the AMQP frames of one direction of a connection
// and counts the billable methods among them.
type frameScanner struct {
	counts *frameCounts
	skip   int     // the protocol header a client sends first
	hdr    [7]byte // type, channel, size
	hn     int
	left   int // payload and frame-end bytes still to pass
	method [4]byte
	mn     int
}

func (s *frameScanner) feed(b []byte) {
	for len(b) > 0 {
		switch {
		case s.skip > 0:
			n := min(s.skip, len(b))
			s.skip, b = s.skip-n, b[n:]
		case s.hn < len(s.hdr):
			n := copy(s.hdr[s.hn:], b)
			s.hn, b = s.hn+n, b[n:]
			if s.hn == len(s.hdr) {
				s.left, s.mn = int(binary.BigEndian.Uint32(s.hdr[3:]))+1, 0
			}
		default:
			n := min(s.left, len(b))
			if s.hdr[0] == 1 && s.mn < 4 { // a method frame: class and method first
				c := copy(s.method[s.mn:], b[:n])
				s.mn += c
				if s.mn == 4 {
					class, method := binary.BigEndian.Uint16(s.method[:2]), binary.BigEndian.Uint16(s.method[2:])
					switch {
					case class == 60 && method == 40:
						s.counts.publish.Add(1)
					case class == 60 && method == 60:
						s.counts.deliver.Add(1)
					case class == 60 && method == 71:
						s.counts.getOK.Add(1)
					}
				}
			}
			s.left, b = s.left-n, b[n:]
			if s.left == 0 {
				s.hn = 0
			}
		}
	}
}

func newTCPProxy(t testing.TB, target string) *tcpProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &tcpProxy{t: t, target: target, ln: ln, addr: ln.Addr().String()}
	go p.serve()
	t.Cleanup(func() { p.Close() })
	return p
}

// newTLSProxy is a proxy that ends TLS in front of target, as a broker with
// an amqps listener would, with localCert's certificate, whose CA file
// URL names (amqp091-go's cacertfile).
func newTLSProxy(t testing.TB, target string) *tcpProxy {
	t.Helper()
	der, key, caFile := localCert(t)
	p := newTCPProxy(t, target)
	p.mu.Lock()
	p.tls = &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}
	p.caFile = caFile
	p.mu.Unlock()
	return p
}

// Retarget sends the connections the proxy takes from now on to target.
func (p *tcpProxy) Retarget(target string) {
	p.mu.Lock()
	p.target = target
	p.mu.Unlock()
}

func (p *tcpProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.tls != nil {
			c = tls.Server(c, p.tls)
		}
		target := p.target
		p.mu.Unlock()
		up, err := net.Dial("tcp", target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		go p.pipe(c, up, false)
		go p.pipe(up, c, true)
	}
}

func (p *tcpProxy) pipe(dst, src net.Conn, fromClient bool) {
	p.mu.Lock()
	var scan interface{ feed([]byte) }
	switch {
	case p.frames != nil:
		fs := &frameScanner{counts: p.frames}
		if fromClient {
			fs.skip = 8 // "AMQP" 0 0 9 1
		}
		scan = fs
	case p.trips != nil && fromClient:
		scan = &pgScanner{trips: p.trips}
	}
	dropOver := p.dropOver
	p.mu.Unlock()
	if p.delay > 0 {
		p.delayedPipe(dst, src, scan, p.links[map[bool]int{true: 0, false: 1}[fromClient]])
		return
	}
	buf := make([]byte, 32<<10)
	var sent int64
	for {
		n, err := src.Read(buf)
		if n > 0 && scan != nil {
			scan.feed(buf[:n])
		}
		p.moved.Add(int64(n))
		if sent += int64(n); fromClient && dropOver > 0 && sent > dropOver {
			break
		}
		if n > 0 {
			for p.isStalled() || !fromClient && p.areRepliesStalled() {
				time.Sleep(10 * time.Millisecond)
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	dst.Close()
	src.Close()
}

// delayedPipe forwards src to dst, each chunk delay after it left link
// (at once without a bandwidth), in order: a WAN link, one way. scan,
// when set, counts the billable methods as they arrive. The
// chunks that are due together go out in one write, and read buffers are
// reused: the proxy stands in for the internet, which takes none of the
// machine's two cores, so it should take as little of them as it can.
func (p *tcpProxy) delayedPipe(dst, src net.Conn, scan interface{ feed([]byte) }, link *wanLink) {
	type chunk struct {
		buf *[]byte
		n   int
		at  time.Time
	}
	q := make(chan chunk, 1<<14)
	go func() {
		defer close(q)
		for {
			buf := proxyBuffers.Get().(*[]byte)
			n, err := src.Read(*buf)
			if n > 0 && scan != nil {
				scan.feed((*buf)[:n])
			}
			p.moved.Add(int64(n))
			if n > 0 {
				q <- chunk{buf, n, link.departs(n, time.Now()).Add(p.delay)}
			} else {
				proxyBuffers.Put(buf)
			}
			if err != nil {
				return
			}
		}
	}()
	var due []chunk
	var next *chunk // taken from q, not yet due
	for {
		if next == nil {
			c, ok := <-q
			if !ok {
				break
			}
			next = &c
		}
		if wait := time.Until(next.at); wait > 0 {
			time.Sleep(wait)
		}
		due, next = append(due[:0], *next), nil
		now := time.Now()
	more:
		for len(due) < 64 {
			select {
			case c, ok := <-q:
				if !ok {
					break more
				}
				if c.at.After(now) {
					next = &c
					break more
				}
				due = append(due, c)
			default:
				break more
			}
		}
		bufs := make(net.Buffers, len(due))
		for i, c := range due {
			bufs[i] = (*c.buf)[:c.n]
		}
		_, err := bufs.WriteTo(dst)
		for _, c := range due {
			proxyBuffers.Put(c.buf)
		}
		if err != nil {
			break
		}
	}
	dst.Close()
	src.Close()
	for c := range q {
		proxyBuffers.Put(c.buf)
	}
}

// proxyBuffers are delayedPipe's read buffers.
var proxyBuffers = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// localCert is a certificate for 127.0.0.1, self-signed, its key, and a
// CA file of it (PEM) for a client to trust.
func localCert(t testing.TB) (der []byte, key *ecdsa.PrivateKey, caFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "switchyard test server"},
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	if der, err = x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key); err != nil {
		t.Fatal(err)
	}
	caFile = filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return der, key, caFile
}

// newWANProxy is a broker across a WAN link: TLS ended at the proxy (the
// client dials amqps and trusts the proxy's CA) and each direction delayed
// by half of rtt.
func newWANProxy(t testing.TB, target string, rtt time.Duration) *tcpProxy {
	t.Helper()
	p := newTLSProxy(t, target)
	p.mu.Lock()
	p.delay = rtt / 2
	p.mu.Unlock()
	return p
}

func (p *tcpProxy) isStalled() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stalled && !p.closed
}

func (p *tcpProxy) areRepliesStalled() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.repliesStalled && !p.closed
}

// StallReplies stops forwarding the broker's bytes to the client (a
// confirm lost on the way back); the client's still arrive.
func (p *tcpProxy) StallReplies(on bool) {
	p.mu.Lock()
	p.repliesStalled = on
	p.mu.Unlock()
}

// Stall stops forwarding bytes; connections stay open.
func (p *tcpProxy) Stall(on bool) {
	p.mu.Lock()
	p.stalled = on
	p.mu.Unlock()
}

// Cut drops every open connection; new ones are still accepted.
func (p *tcpProxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// Close drops everything and stops listening: the broker is unreachable.
func (p *tcpProxy) Close() {
	p.ln.Close()
	p.Cut() // before closed, so that no stalled byte slips through
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
}

// Reopen listens again on the same address after Close.
func (p *tcpProxy) Reopen() {
	p.t.Helper()
	var ln net.Listener
	var err error
	for i := 0; i < 50; i++ {
		if ln, err = net.Listen("tcp", p.addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		p.t.Fatalf("reopen proxy on %s: %v", p.addr, err)
	}
	p.mu.Lock()
	p.ln, p.closed, p.stalled = ln, false, false
	p.mu.Unlock()
	go p.serve()
}

// URL is an AMQP URL to vhost through the proxy: amqps, trusting the
// proxy's certificate, when the proxy ends TLS.
func (p *tcpProxy) URL(vhost string) string {
	userinfo := testBroker().url.User.String() + "@"
	if p.tls != nil {
		return "amqps://" + userinfo + p.addr + "/" + url.PathEscape(vhost) + "?cacertfile=" + url.QueryEscape(p.caFile)
	}
	return "amqp://" + userinfo + p.addr + "/" + url.PathEscape(vhost)
}
