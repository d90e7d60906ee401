package main

// The bench's load generators: clients that post signed webhooks over
// kept-alive connections, closed loop (sustained: each client waits for its
// answer) and, in bench_openloop_test.go, open loop (at a rate).

import (
	"bufio"
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// loadClient is the load generator: HTTP/1.1 POSTs over keep-alive
// connections, each request one write (its header and body pieces in a
// writev), each answer read on the caller's goroutine. GitHub's servers are
// not on the VPS, so the load generator should take as little as it can of
// the two cores the daemon and RabbitMQ share, and add no waits of its own:
// net/http's client passed every request and answer through two goroutines
// of its own per connection, and took 27 µs more CPU per 25 KB POST than
// this one (against a bare server, 81 against 55 µs for both ends).
type loadClient struct {
	addr string // host:port
	idle chan *loadConn
}

type loadConn struct {
	c net.Conn
	r *bufio.Reader
}

// newLoadClient posts to base ("http://host:port"), keeping up to conns
// connections open between requests.
func newLoadClient(base string, conns int) *loadClient {
	return &loadClient{addr: strings.TrimPrefix(base, "http://"), idle: make(chan *loadConn, conns)}
}

// post sends body (its pieces, in order) to path with header's fields and
// returns the answer's status. A failed exchange closes its connection and
// is not retried: a POST sent twice would be a second webhook.
func (lc *loadClient) post(path string, header http.Header, body ...[]byte) (int, error) {
	var c *loadConn
	select {
	case c = <-lc.idle:
	default:
		conn, err := net.Dial("tcp", lc.addr)
		if err != nil {
			return 0, err
		}
		c = &loadConn{c: conn, r: bufio.NewReader(conn)}
	}
	n := 0
	for _, p := range body {
		n += len(p)
	}
	var head bytes.Buffer
	fmt.Fprintf(&head, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n", path, lc.addr, n)
	_ = header.Write(&head)
	head.WriteString("\r\n")
	bufs := append(net.Buffers{head.Bytes()}, body...)
	if _, err := bufs.WriteTo(c.c); err != nil {
		c.c.Close()
		return 0, err
	}
	status, keep, err := c.answer()
	if err != nil || !keep {
		c.c.Close()
		return status, err
	}
	select {
	case lc.idle <- c:
	default:
		c.c.Close()
	}
	return status, nil
}

// answer reads one response: its status, whether the connection stays open,
// and its body (discarded, by Content-Length; the daemon's answers have one).
func (c *loadConn) answer() (status int, keep bool, err error) {
	line, err := c.r.ReadSlice('\n')
	if err != nil {
		return 0, false, err
	}
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.1 ")) {
		return 0, false, fmt.Errorf("bad status line %q", line)
	}
	if status, err = strconv.Atoi(string(line[9:12])); err != nil {
		return 0, false, fmt.Errorf("bad status line %q", line)
	}
	length, keep := -1, true
	for {
		line, err := c.r.ReadSlice('\n')
		if err != nil {
			return status, false, err
		}
		field := bytes.TrimRight(line, "\r\n")
		if len(field) == 0 {
			break
		}
		k, v, _ := bytes.Cut(field, []byte(":"))
		v = bytes.TrimSpace(v)
		switch strings.ToLower(string(k)) {
		case "content-length":
			if length, err = strconv.Atoi(string(v)); err != nil {
				return status, false, fmt.Errorf("bad Content-Length %q", v)
			}
		case "connection":
			keep = !bytes.EqualFold(v, []byte("close"))
		}
	}
	if length < 0 {
		return status, false, errors.New("answer without Content-Length")
	}
	_, err = c.r.Discard(length)
	return status, keep && err == nil, err
}

// parallelRate runs fn n times from `workers` goroutines and returns calls/s;
// the first error stops the benchmark.
func parallelRate(b testing.TB, workers, n int, fn func(i int) error) float64 {
	var next atomic.Int64
	var wg sync.WaitGroup
	var first atomic.Value
	start := time.Now()
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1))
				if i > n || first.Load() != nil {
					return
				}
				if err := fn(i); err != nil {
					first.CompareAndSwap(nil, err)
				}
			}
		}()
	}
	wg.Wait()
	if err := first.Load(); err != nil {
		b.Fatal(err)
	}
	return float64(n) / time.Since(start).Seconds()
}

// botBody is a bot pull_request payload laid out so that webhooks differ
// only in their last bytes: the pull request's node id (so each writes its
// own typed row) is the last member of the last member. GitHub signs on its
// own servers; the load generator, on the two cores the daemon and RabbitMQ
// need, keeps an HMAC fed the common head and clones it for each webhook,
// hashing only the few bytes after it, instead of 25 KB of SHA-256 and a
// string replacement per webhook.
type botBody struct {
	head []byte
	mac  hash.Cloner // HMAC-SHA256 of the secret, fed the head
}

func newBotBody(b testing.TB, payload []byte) *botBody {
	var top, pr map[string]json.RawMessage
	if err := json.Unmarshal(payload, &top); err != nil {
		b.Fatal(err)
	}
	if err := json.Unmarshal(top["pull_request"], &pr); err != nil {
		b.Fatal(err)
	}
	delete(top, "pull_request")
	delete(pr, "node_id")
	rest, _ := json.Marshal(top)
	prRest, _ := json.Marshal(pr)
	head := append(rest[:len(rest)-1:len(rest)-1], `,"pull_request":`...)
	head = append(head, prRest[:len(prRest)-1]...)
	head = append(head, `,"node_id":"`...)

	mac := hmac.New(sha256.New, []byte(testSecret))
	mac.Write(head)
	bb := &botBody{head: head, mac: mac.(hash.Cloner)}
	tail := bb.tail("check")
	if got, want := bb.sign(tail), sign(testSecret, append(bytes.Clone(head), tail...)); got != want {
		b.Fatalf("botBody signs %s, want %s", got, want)
	}
	return bb
}

func (bb *botBody) tail(node string) []byte { return []byte(node + `"}}`) }

// sign is sign(testSecret, head+tail), hashing only the tail.
func (bb *botBody) sign(tail []byte) string {
	h, err := bb.mac.Clone()
	if err != nil {
		panic(err)
	}
	h.Write(tail)
	return "sha256=" + hex.EncodeToString(h.Sum(nil))
}

// botPost sends one signed bot pull_request webhook with its own node id, so
// that it writes its own typed row; it returns the latency and an error
// unless the answer is 202.
func botPost(client *loadClient, guid string, body *botBody) (time.Duration, error) {
	tail := body.tail("node-" + guid)
	h := http.Header{}
	h.Set("Content-Type", "application/json")
	h.Set("X-GitHub-Event", "pull_request")
	h.Set("X-GitHub-Delivery", guid)
	h.Set("X-GitHub-Hook-ID", "123456")
	h.Set("X-GitHub-Hook-Installation-Target-Type", "integration")
	h.Set("X-GitHub-Hook-Installation-Target-ID", strconv.Itoa(testBotAppID))
	h.Set("X-Hub-Signature-256", body.sign(tail))
	start := time.Now()
	status, err := client.post("/webhooks/github", h, body.head, tail)
	if err != nil {
		return 0, err
	}
	if status != http.StatusAccepted {
		return 0, fmt.Errorf("POST: %d", status)
	}
	return time.Since(start), nil
}

// sustained posts from `clients` goroutines for d, then waits until github
// and github_pull_requests both hold every webhook posted; the rate is
// webhooks per second from the first POST to the last row, n how many.
func sustained(b testing.TB, p *benchProcess, payload []byte, clients int, d time.Duration) (rate float64, n int) {
	return sustainedOn(b, []*benchProcess{p}, payload, clients, d)
}

// sustainedOn is sustained with the clients spread over nodes that share
// one database, the first node's.
func sustainedOn(b testing.TB, nodes []*benchProcess, payload []byte, clients int, d time.Duration) (rate float64, n int) {
	body := newBotBody(b, payload)
	var loads []*loadClient
	for _, p := range nodes {
		loads = append(loads, newLoadClient(p.url, clients/len(nodes)+1))
	}
	db := openStoreDB(b, nodes[0].database)
	prefix := "sus-" + randHex(3) + "-"
	var posted atomic.Int64
	var failed atomic.Value
	var wg sync.WaitGroup
	deadline := time.Now().Add(d)
	start := time.Now()
	for c := 0; c < clients; c++ {
		client := loads[c%len(loads)]
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) && failed.Load() == nil {
				if _, err := botPost(client, fmt.Sprintf("%s%d", prefix, posted.Add(1)), body); err != nil {
					failed.CompareAndSwap(nil, err)
				}
			}
		}()
	}
	wg.Wait()
	if err := failed.Load(); err != nil {
		b.Fatal(err)
	}
	want := int(posted.Load())
	eventually(b, 10*time.Minute, "every webhook in github and github_pull_requests", func() bool {
		return queryInt(b, db, "SELECT count(*) FROM github WHERE delivery_id LIKE $1", prefix+"%") == want &&
			queryInt(b, db, "SELECT count(*) FROM github_pull_requests WHERE delivery_id LIKE $1", prefix+"%") == want
	})
	return float64(want) / time.Since(start).Seconds(), want
}
