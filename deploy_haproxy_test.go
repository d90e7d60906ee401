package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// haproxy is the one `make test` unpacks from Debian's package (HAPROXY),
// one on PATH, or else it is fetched as make does.
func haproxy(t testing.TB) string {
	t.Helper()
	if p := os.Getenv("HAPROXY"); p != "" {
		return p
	}
	if p, err := exec.LookPath("haproxy"); err == nil {
		return p
	}
	p, _ := filepath.Abs(".tools/haproxy")
	if _, err := os.Stat(p); err != nil {
		if out, err := exec.Command("make", "-s", ".tools/haproxy").CombinedOutput(); err != nil {
			t.Fatalf("no haproxy, and make .tools/haproxy failed: %v\n%s", err, out)
		}
	}
	return p
}

// shippedHAProxy is deploy/haproxy.cfg with its addresses put in: the
// frontend's bind on front, one server line a node.
func shippedHAProxy(t testing.TB, front string, nodes []string) string {
	t.Helper()
	raw, err := os.ReadFile("deploy/haproxy.cfg")
	if err != nil {
		t.Fatal(err)
	}
	cfg := regexp.MustCompile(`(?m)^    bind \S+$`).ReplaceAllString(string(raw), "    bind "+front)
	cfg = regexp.MustCompile(`(?m)^    log /dev/log .*$`).ReplaceAllString(cfg, "    log stderr format short local0 notice")
	var servers strings.Builder
	for i, n := range nodes {
		fmt.Fprintf(&servers, "    server node-%d %s\n", i+1, n)
	}
	lines := regexp.MustCompile(`(?m)^    server .*\n`)
	if got := len(lines.FindAllString(cfg, -1)); got == 0 {
		t.Fatal("deploy/haproxy.cfg has no server lines")
	}
	first := true
	cfg = lines.ReplaceAllStringFunc(cfg, func(string) string {
		if first {
			first = false
			return servers.String()
		}
		return ""
	})
	p := filepath.Join(t.TempDir(), "haproxy.cfg")
	if err := os.WriteFile(p, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// The shipped balancer config is what the README says: checks of /readyz
// every second, two failures to take a node out, webhooks sent again to
// another node, timeouts under GitHub's 10 s; haproxy -c takes it.
func TestShippedHAProxyConfig(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("deploy/haproxy.cfg")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"option httpchk GET /readyz", "http-check expect status 200", "inter 1s fall 2",
		"option redispatch", "retry-on conn-failure empty-response", "option http-buffer-request"} {
		if !strings.Contains(string(raw), want) {
			t.Errorf("deploy/haproxy.cfg lacks %q", want)
		}
	}
	for _, m := range regexp.MustCompile(`(?m)^\s*timeout (\S+) (\d+)s$`).FindAllStringSubmatch(string(raw), -1) {
		if n := m[2]; len(n) > 1 || n == "0" {
			t.Errorf("timeout %s %ss: not under GitHub's 10 s", m[1], n)
		}
	}
	if n := len(regexp.MustCompile(`(?m)^frontend `).FindAllString(string(raw), -1)); n != 1 {
		t.Errorf("%d frontends, want 1", n)
	}
	if n := len(regexp.MustCompile(`(?m)^backend `).FindAllString(string(raw), -1)); n != 1 {
		t.Errorf("%d backends, want 1", n)
	}
	out, err := exec.Command(haproxy(t), "-c", "-f", shippedHAProxy(t, "127.0.0.1:1", []string{"127.0.0.1:2"})).CombinedOutput()
	if err != nil {
		t.Errorf("haproxy -c: %v\n%s", err, out)
	}
}

// Three nodes on one PostgreSQL behind Debian's haproxy with the shipped
// config, each with drain_delay 3s: under a steady stream of webhooks, a
// rolling restart of all three and then a SIGKILL of one. Every request
// is answered 202 and each delivery stored once.
func TestFleetBehindHAProxyRefusesNothing(t *testing.T) {
	t.Parallel()
	needPostgres(t)
	vhost := newVhost(t)
	dbURL := newPostgresDatabase(t)
	type node struct {
		addr, config string
		cmd          *exec.Cmd
		out          *syncBuffer
	}
	nodes := make([]*node, 3)
	var addrs []string
	for i := range nodes {
		n := &node{addr: freeAddr(t)}
		n.config = writeConfigWith(t, t.TempDir(), n.addr, fmt.Sprintf("driver = \"postgres\"\nurl = %q\nmax_conns = 4", dbURL),
			fmt.Sprintf("node_name = \"node-%d\"\nlease_ttl = \"2s\"\ndrain_delay = \"3s\"\ntrusted_proxies = [\"127.0.0.1\"]", i+1),
			amqpURL(vhost))
		nodes[i], addrs = n, append(addrs, n.addr)
	}
	for _, n := range nodes {
		n.cmd, n.out = startProcess(t, n.config, n.addr)
	}
	front := freeAddr(t)
	lbOut := started(t, exec.Command(haproxy(t), "-db", "-f", shippedHAProxy(t, front, addrs)))
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("haproxy:\n%s", lbOut)
		}
	})
	// Every node up behind the balancer: three answers in a row, one each.
	stats := func() string { return lbOut.String() }
	eventually(t, 30*time.Second, "haproxy taking webhooks", func() bool { return answersOK("http://" + front + "/readyz") })

	stop, got := webhookStream(t, "http://"+front, loadFixture(t, "issues", "opened"), 4, 50*time.Millisecond)
	answered := func() int { return len(got()) }
	waitMore := func(what string, n int) {
		before := answered()
		eventually(t, 30*time.Second, what, func() bool { return answered() >= before+n })
	}
	waitMore("webhooks before the restarts", 40)
	// The rolling restart: each node drains, stops, starts again, and is
	// back in the balancer (its /readyz ready twice) before the next.
	for i, n := range nodes {
		stopProcess(t, n.cmd, n.out, 30*time.Second)
		if !strings.Contains(n.out.String(), "draining") {
			t.Errorf("node %d did not drain:\n%s", i+1, n.out)
		}
		n.cmd, n.out = startProcess(t, n.config, n.addr)
		eventually(t, 30*time.Second, fmt.Sprintf("node %d back in the balancer", i+1), func() bool {
			return strings.Contains(stats(), fmt.Sprintf("switchyard/node-%d is UP", i+1))
		})
		waitMore(fmt.Sprintf("webhooks after node %d's restart", i+1), 20)
	}
	// A node dies with webhooks in hand.
	if err := nodes[1].cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = nodes[1].cmd.Wait()
	eventually(t, 30*time.Second, "the dead node out of the balancer", func() bool {
		return strings.Contains(stats(), "switchyard/node-2 is DOWN")
	})
	waitMore("webhooks after the SIGKILL", 40)
	stop()

	answers := got()
	allAccepted(t, answers, "through a rolling restart and a SIGKILL")
	db := openStoreDB(t, DatabaseConfig{Driver: "postgres", URL: dbURL})
	eventually(t, 60*time.Second, fmt.Sprintf("%d deliveries stored", len(answers)), func() bool {
		return queryInt(t, db, "SELECT count(DISTINCT delivery_id) FROM github") >= len(answers)
	})
	if n, distinct := queryInt(t, db, "SELECT count(*) FROM github"), queryInt(t, db, "SELECT count(DISTINCT delivery_id) FROM github"); n != distinct || distinct != len(answers) {
		t.Errorf("github holds %d rows of %d deliveries, want each of the %d once", n, distinct, len(answers))
	}
	t.Logf("%d webhooks through a rolling restart and a SIGKILL, all 202", len(answers))
}
