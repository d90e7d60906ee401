package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// hcServer records the pings it gets, as "path body".
type hcServer struct {
	srv   *httptest.Server
	mu    sync.Mutex
	pings []string
}

func newHCServer(t testing.TB) *hcServer {
	t.Helper()
	h := &hcServer{}
	h.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		h.mu.Lock()
		h.pings = append(h.pings, strings.TrimPrefix(r.URL.Path, "/ping/uuid")+" "+string(b))
		h.mu.Unlock()
	}))
	t.Cleanup(h.srv.Close)
	return h
}

func (h *hcServer) seen() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.pings...)
}

// runWorker runs a service worker over one broker URL with the given ping URL
// until the test ends.
func runWorker(t *testing.T, brokerURL, pingURL string) (*Store, *logSink) {
	t.Helper()
	cfg := testConfig(t, brokerURL)
	ctx, cancel := context.WithCancel(context.Background())
	p := newParts(t, cfg)
	store, brokers, queues, log, sink := p.store, p.brokers, p.queues, p.log, p.logs
	pings := NewHealthChecks(nil, log)
	w := NewEventWorker(WorkerOptions{Name: "service", Queue: queueGitHub,
		Window: 200 * time.Millisecond, Health: pings.For(pingURL, "service")},
		EventOptions{Handle: serviceHandler(nil, 0, false), Batch: store}, cfg.Workers, brokers, queues, log)
	done := make(chan struct{}, 2)
	go func() { _ = pings.Run(ctx, Holding{}); done <- struct{}{} }()
	go func() { _ = w.Run(ctx, Holding{}); done <- struct{}{} }()
	t.Cleanup(func() { cancel(); <-done; <-done })
	return store, sink
}

// A good cycle pings /start then the URL; a failing one /start then /fail
// with the reason.
func TestHealthChecksPings(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	hc := newHCServer(t)
	runWorker(t, proxy.URL(vhost), hc.srv.URL+"/ping/uuid")

	eventually(t, 10*time.Second, "start and success pings", func() bool {
		p := hc.seen()
		return len(p) >= 2 && p[0] == "/start " && p[1] == " "
	})
	proxy.Close()
	eventually(t, 20*time.Second, "a fail ping with a reason", func() bool {
		p := hc.seen()
		for i := 1; i < len(p); i++ {
			if strings.HasPrefix(p[i], "/fail ") && strings.Contains(p[i], "unreachable") && p[i-1] == "/start " {
				return true
			}
		}
		return false
	})
}

// HealthChecks down changes nothing else: the worker still stores messages.
func TestHealthChecksDown(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	declareTestTopology(t, vhost, 200*time.Millisecond)
	store, sink := runWorker(t, amqpURL(vhost), "http://"+reserveAddr(t)+"/ping/uuid")
	guid := newGUID()
	publishRaw(t, vhost, "", queueGitHub, eventMessage("issues", guid, loadFixture(t, "issues", "opened")))
	eventually(t, 10*time.Second, "message stored with HealthChecks down", func() bool {
		var n int
		_ = store.r.QueryRow("SELECT count(*) FROM github WHERE delivery_id = $1", guid).Scan(&n)
		return n == 1
	})
	if !strings.Contains(sink.String(), "healthchecks ping failed") {
		t.Errorf("no warning about the failed ping")
	}
	if strings.Contains(sink.String(), "cycle failed") {
		t.Errorf("a failed ping failed a cycle")
	}
	if strings.Contains(sink.String(), "/ping/uuid") {
		t.Errorf("the ping URL's secret path is in the log")
	}
}

// The pings' sender acts only through the holding it is handed: a ping a
// worker made before this node took the healthchecks lease (waiting while
// another node pinged) is dropped, the ones made since are sent in order.
func TestHealthChecksPingOnlyUnderTheirHolding(t *testing.T) {
	t.Parallel()
	hc := newHCServer(t)
	l := heldLease(jobHealthChecks, 1)
	pings := NewHealthChecks(nil, slog.New(slog.DiscardHandler))
	w := pings.For(hc.srv.URL+"/ping/uuid", "service")
	w.Fail("made before the holding")
	held := Holding{lease: l, term: 1, since: time.Now()}
	w.Start()
	w.Success()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = pings.Run(ctx, held); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	eventually(t, 10*time.Second, "the pings made under the holding", func() bool { return len(hc.seen()) >= 2 })
	if got := hc.seen(); got[0] != "/start " || got[1] != " " {
		t.Errorf("pings %q, want /start then the URL, the earlier /fail dropped", got)
	}
}

// A ping already past its checks when the process resumes past its lease
// (Held asked, Within's timer not yet fired: send under a context that has
// not ended) writes nothing: the holding's connections ask Held right
// before each write, a connection kept alive from an earlier ping as a new
// one. The ping is logged as not held.
func TestHealthChecksPingStopsAtTheWrite(t *testing.T) {
	t.Parallel()
	hc := newHCServer(t)
	sink := &logSink{t: t}
	l := heldLease(jobHealthChecks, 1)
	held := Holding{lease: l, term: 1, since: time.Now()}
	pings := NewHealthChecks(nil, slog.New(slog.NewTextHandler(sink, nil)))
	client := pingClient(held)
	defer client.CloseIdleConnections()
	ping := func(suffix string) {
		pings.send(context.Background(), client, ping{worker: "service", url: hc.srv.URL + "/ping/uuid", suffix: suffix})
	}
	ping("/start")
	if got := hc.seen(); len(got) != 1 {
		t.Fatalf("pings %q while held, want /start", got)
	}
	lapse(l) // paused past it; the loop has not run
	ping("") // on the connection /start left open
	ping("/fail")
	if got := hc.seen(); len(got) != 1 {
		t.Errorf("pings %q, want none after the holding lapsed", got)
	}
	if strings.Count(sink.String(), ErrNotHeld.Error()) != 2 {
		t.Errorf("log:\n%s\nwant both pings failed as not held", sink.String())
	}
}

// A holding's guarded connection writes while it holds and not after; the
// zero Holding's is the connection itself.
func TestHoldingGuardWritesOnlyWhileHeld(t *testing.T) {
	t.Parallel()
	l := heldLease(jobAlerts, 1)
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if (Holding{}).Guard(a) != a {
		t.Error("the zero Holding guards its connection")
	}
	c := Holding{lease: l, term: 1}.Guard(a)
	go func() { _, _ = io.Copy(io.Discard, b) }()
	if _, err := c.Write([]byte("held")); err != nil {
		t.Fatalf("write while held: %v", err)
	}
	lapse(l)
	if n, err := c.Write([]byte("lapsed")); n != 0 || !errors.Is(err, ErrNotHeld) {
		t.Errorf("write after the holding lapsed: %d, %v; want 0, ErrNotHeld", n, err)
	}
}
