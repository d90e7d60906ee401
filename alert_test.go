package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// gate holds a sink's answers while it stalls (hold), until released.
type gate struct {
	mu sync.Mutex
	ch chan struct{}
}

// hold makes every answer wait until the returned release is called.
func (g *gate) hold() (release func()) {
	ch := make(chan struct{})
	g.mu.Lock()
	g.ch = ch
	g.mu.Unlock()
	var once sync.Once
	return func() { once.Do(func() { close(ch) }) }
}

func (g *gate) wait() {
	g.mu.Lock()
	ch := g.ch
	g.mu.Unlock()
	if ch != nil {
		<-ch
	}
}

// smtpSink is a minimal SMTP server that keeps every message it is given.
type smtpSink struct {
	gate
	ln   net.Listener
	addr string
	mu   sync.Mutex
	msgs []string
}

func newSMTPSink(t testing.TB) *smtpSink {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &smtpSink{ln: ln, addr: ln.Addr().String()}
	go s.serve()
	t.Cleanup(func() { ln.Close() })
	return s
}

// reserveAddr returns an address where nothing listens yet, for a sink that
// is down and comes up later.
func reserveAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func newSMTPSinkAt(t testing.TB, addr string) *smtpSink {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	s := &smtpSink{ln: ln, addr: addr}
	go s.serve()
	t.Cleanup(func() { ln.Close() })
	return s
}

func (s *smtpSink) serve() {
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		go s.session(c)
	}
}

func (s *smtpSink) session(c net.Conn) {
	defer c.Close()
	s.wait()
	r := bufio.NewReader(c)
	say := func(line string) { io.WriteString(c, line+"\r\n") }
	say("220 sink ESMTP")
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return
		}
		cmd := strings.ToUpper(strings.TrimSpace(line))
		switch {
		case strings.HasPrefix(cmd, "EHLO"), strings.HasPrefix(cmd, "HELO"):
			say("250-sink")
			say("250 8BITMIME")
		case cmd == "DATA":
			say("354 go ahead")
			var b strings.Builder
			for {
				l, err := r.ReadString('\n')
				if err != nil {
					return
				}
				if l == ".\r\n" {
					break
				}
				b.WriteString(l)
			}
			s.mu.Lock()
			s.msgs = append(s.msgs, b.String())
			s.mu.Unlock()
			say("250 queued")
		case cmd == "QUIT":
			say("221 bye")
			return
		default:
			say("250 OK")
		}
	}
}

func (s *smtpSink) messages() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.msgs...)
}

// pushSink records ntfy-style POSTs.
type pushSink struct {
	gate
	srv  *httptest.Server
	mu   sync.Mutex
	reqs []pushReq
}

type pushReq struct {
	title, tags, click, auth, body string
}

func newPushSink(t testing.TB) *pushSink {
	t.Helper()
	p := &pushSink{}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.wait()
		b, _ := io.ReadAll(r.Body)
		p.mu.Lock()
		p.reqs = append(p.reqs, pushReq{r.Header.Get("Title"), r.Header.Get("Tags"), r.Header.Get("Click"), r.Header.Get("Authorization"), string(b)})
		p.mu.Unlock()
	}))
	t.Cleanup(p.srv.Close)
	return p
}

func (p *pushSink) requests() []pushReq {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]pushReq(nil), p.reqs...)
}

func alertConfig(t *testing.T, smtpAddr, pushURL string, events ...string) *Config {
	t.Helper()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	host, port, _ := net.SplitHostPort(smtpAddr)
	p, _ := strconv.Atoi(port)
	cfg.Alerts = AlertsConfig{
		Rules: []AlertRule{{Events: events, Channels: []string{"email", "push"}}},
		Email: EmailConfig{Host: host, Port: p, From: "switchyard@example.com", To: []string{"ops@example.com"}, TLS: "none"},
		Push:  PushConfig{URL: pushURL, Token: "push-secret-token"},
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	return cfg
}

func TestMatchPattern(t *testing.T) {
	t.Parallel()
	tests := []struct {
		pattern, event, action string
		want                   bool
	}{
		{"*", "push", "", true},
		{"pull_request.*", "pull_request", "opened", true},
		{"pull_request.*", "issues", "opened", false},
		{"issues.opened", "issues", "opened", true},
		{"issues.opened", "issues", "closed", false},
		{"push", "push", "", true},
		{"push", "pull_request", "", false},
	}
	for _, tt := range tests {
		if got := matchPattern(tt.pattern, tt.event, tt.action); got != tt.want {
			t.Errorf("matchPattern(%q, %s.%s): got %v, want %v", tt.pattern, tt.event, tt.action, got, tt.want)
		}
	}
}

// A rule for pull_request.opened sends one email and one push that tell what
// happened; an Event it does not match sends nothing.
func TestAlertsSent(t *testing.T) {
	t.Parallel()
	onBothStores(t, testAlertsSent)
}

func testAlertsSent(t *testing.T) {
	smtp, push := newSMTPSink(t), newPushSink(t)
	cfg := alertConfig(t, smtp.addr, push.srv.URL, "pull_request.opened")
	d := startDaemon(t, cfg)
	pr := newGUID()
	postWebhook(t, d.URL, "pull_request", pr, loadFixture(t, "pull_request", "opened"))
	other := newGUID()
	postWebhook(t, d.URL, "issues", other, loadFixture(t, "issues", "opened"))

	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "alert sent and recorded", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1 AND alerted_at IS NOT NULL", pr) == 1 &&
			queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", other) == 1
	})
	d.stop(t)
	msgs := smtp.messages()
	if len(msgs) != 1 {
		t.Fatalf("emails: %d, want 1", len(msgs))
	}
	for _, want := range []string{"Subject: pull_request.opened on octo-org/switchyard-demo by mona",
		"https://github.com/octo-org/switchyard-demo/pull/42", "Action:     opened", pr} {
		if !strings.Contains(msgs[0], want) {
			t.Errorf("email lacks %q:\n%s", want, msgs[0])
		}
	}
	reqs := push.requests()
	if len(reqs) != 1 {
		t.Fatalf("pushes: %d, want 1", len(reqs))
	}
	p := reqs[0]
	if p.title != "pull_request.opened on octo-org/switchyard-demo by mona" || p.click != "https://github.com/octo-org/switchyard-demo/pull/42" ||
		!strings.Contains(p.tags, "pull_request") || p.auth != "Bearer push-secret-token" || !strings.Contains(p.body, "octo-org/switchyard-demo") {
		t.Errorf("push: %+v", p)
	}
	if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1 AND alerted_at IS NULL", other); n != 1 {
		t.Errorf("the non-matching Event was marked alerted")
	}
	if strings.Contains(d.logs.String(), "push-secret-token") {
		t.Errorf("the push token is in the log")
	}
}

// The SMTP server down: the message is stored and acked at once, the email
// alert retries from the outbox, the push is not sent twice, and the row and
// its count are written once; once SMTP is back, the email goes out.
func TestAlertRetriesOnlyTheAlert(t *testing.T) {
	t.Parallel()
	onBothStores(t, testAlertRetriesOnlyTheAlert)
}

func testAlertRetriesOnlyTheAlert(t *testing.T) {
	addr := reserveAddr(t)
	push := newPushSink(t)
	cfg := alertConfig(t, addr, push.srv.URL, "pull_request.*")
	d := startDaemon(t, cfg)
	guid := newGUID()
	postWebhook(t, d.URL, "pull_request", guid, loadFixture(t, "pull_request", "opened"))

	eventually(t, 20*time.Second, "a retry of the email alert", func() bool {
		return strings.Count(d.logs.String(), "alert not sent, will retry") >= 2
	})
	db := openStoreDB(t, cfg.Database)
	if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1 AND alerted_at IS NULL", guid); n != 1 {
		t.Fatalf("row while the alert fails: %d, want stored once and not alerted", n)
	}
	if strings.Contains(d.logs.String(), "transient failure, message will retry") {
		t.Errorf("the message was retried for its alert; it should be acked once stored")
	}
	if n := queryInt(t, db, "SELECT count(*) FROM alert_outbox WHERE delivery_id = $1 AND channel = 'email' AND sent_at IS NULL AND attempts >= 2 AND last_error != ''", guid); n != 1 {
		t.Errorf("email outbox row: %d, want one unsent with its failures recorded", n)
	}
	smtp := newSMTPSinkAt(t, addr)
	eventually(t, 30*time.Second, "alert sent once SMTP is back", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1 AND alerted_at IS NOT NULL", guid) == 1
	})
	d.stop(t)
	if n := len(smtp.messages()); n != 1 {
		t.Errorf("emails: %d, want 1", n)
	}
	if n := len(push.requests()); n != 1 {
		t.Errorf("pushes: %d, want 1 (sent the first time, never repeated)", n)
	}
	if n := queryInt(t, db, "SELECT count(*) FROM github"); n != 1 {
		t.Errorf("rows: %d, want 1", n)
	}
	if n := queryInt(t, db, "SELECT sum(count) FROM github_statistics_6h"); n != 1 {
		t.Errorf("statistics: %d, want 1", n)
	}
}

// A forbidden Event is stored by cleanup with forbidden = 1, and its alert
// says [Forbidden].
func TestForbiddenAlert(t *testing.T) {
	t.Parallel()
	smtp, push := newSMTPSink(t), newPushSink(t)
	cfg := alertConfig(t, smtp.addr, push.srv.URL, "*")
	cfg.GitHub.AllowedCIDRs = []string{"140.82.112.0/20"}
	d := startDaemon(t, cfg)
	guid := newGUID()
	postWebhook(t, d.URL, "issues", guid, loadFixture(t, "issues", "opened"))
	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "forbidden row alerted", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1 AND forbidden = 1 AND alerted_at IS NOT NULL", guid) == 1
	})
	d.stop(t)
	msgs := smtp.messages()
	if len(msgs) != 1 || !strings.Contains(msgs[0], "Subject: [Forbidden] issues.opened on octo-org/switchyard-demo") {
		t.Errorf("emails: %q", msgs)
	}
	reqs := push.requests()
	if len(reqs) != 1 || !strings.HasPrefix(reqs[0].title, "[Forbidden] ") || !strings.Contains(reqs[0].tags, "warning") {
		t.Errorf("pushes: %+v", reqs)
	}
}

// deliveriesIn are the delivery IDs that alert texts name ("Delivery: ID").
func deliveriesIn(texts []string) map[string]bool {
	ids := map[string]bool{}
	for _, text := range texts {
		for _, line := range strings.Split(text, "\n") {
			if id, ok := strings.CutPrefix(strings.TrimSpace(line), "Delivery:"); ok {
				ids[strings.TrimSpace(id)] = true
			}
		}
	}
	return ids
}

// Alerts are sent after the commit: with the SMTP and push servers stalled, 300 webhooks at
// prefetch 64 are all stored while the stall still holds, /readyz answers 200
// and an operator switch is carried out; once the servers answer, every
// alert goes out.
func TestStalledAlertsNeverSlowStoring(t *testing.T) {
	t.Parallel()
	smtp, push := newSMTPSink(t), newPushSink(t)
	cfg := alertConfig(t, smtp.addr, push.srv.URL, "*")
	cfg.Queue.Prefetch = 64
	releaseSMTP, releasePush := smtp.hold(), push.hold()
	defer releaseSMTP()
	defer releasePush()
	d := startDaemon(t, cfg)
	const n = 300
	body := loadFixture(t, "issues", "opened")
	var wg sync.WaitGroup
	var next atomic.Int64
	for c := 0; c < 16; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1); i <= n; i = next.Add(1) {
				if code := postWebhook(t, d.URL, "issues", fmt.Sprintf("stall-%04d", i), body); code != http.StatusAccepted {
					t.Errorf("webhook %d: %d", i, code)
				}
			}
		}()
	}
	wg.Wait()
	db := openStoreDB(t, cfg.Database)
	eventually(t, 60*time.Second, "every Event stored while the alert servers stall", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github") == n
	})
	if code, answer := do(t, mustRequest(t, http.MethodGet, d.URL+"/readyz")); code != http.StatusOK {
		t.Errorf("/readyz while alerts stall: %d %s", code, answer)
	}
	if code, m := apiCall(t, "POST", d.URL+"/api/v1/broker/switch/0", "operator-token-for-tests", ""); code != http.StatusOK {
		t.Errorf("operator switch while alerts stall: %d %v", code, m)
	}
	if got := scrape(t, d.URL+"/metrics")["switchyard_alerts_pending"]; got != 2*n {
		t.Errorf("switchyard_alerts_pending while the servers stall: %v, want %d", got, 2*n)
	}
	releaseSMTP()
	releasePush()
	eventually(t, 3*time.Minute, "every alert sent once the servers answer", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE alerted_at IS NOT NULL") == n
	})
	if got := len(deliveriesIn(smtp.messages())); got != n {
		t.Errorf("deliveries emailed: %d, want %d", got, n)
	}
	var pushed []string
	for _, r := range push.requests() {
		pushed = append(pushed, r.body)
	}
	if got := len(deliveriesIn(pushed)); got != n {
		t.Errorf("deliveries pushed: %d, want %d", got, n)
	}
}
