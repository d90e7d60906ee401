package main

import (
	"fmt"
	"io"
	"net"
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
		makeTool(t, ".tools/haproxy")
	}
	return p
}

// shippedHAProxy is deploy/haproxy.cfg with its addresses put in: the
// frontend's bind on front, one server line a node and one backup line a
// node, and its stats socket at sock.
func shippedHAProxy(t testing.TB, front, sock string, nodes []string) string {
	t.Helper()
	raw, err := os.ReadFile("deploy/haproxy.cfg")
	if err != nil {
		t.Fatal(err)
	}
	cfg := regexp.MustCompile(`(?m)^    bind \S+$`).ReplaceAllString(string(raw), "    bind "+front)
	cfg = regexp.MustCompile(`(?m)^    stats socket \S+`).ReplaceAllString(cfg, "    stats socket "+sock)
	for _, kind := range []string{"", "backup"} {
		pattern := `(?m)^    server \S+ \S+\n`
		if kind == "backup" {
			pattern = `(?m)^    server \S+ \S+ backup no-check\n`
		}
		lines := regexp.MustCompile(pattern)
		if got := len(lines.FindAllString(cfg, -1)); got == 0 {
			t.Fatalf("deploy/haproxy.cfg has no %s server lines", kind)
		}
		var servers strings.Builder
		for i, n := range nodes {
			if kind == "backup" {
				fmt.Fprintf(&servers, "    server node-%d-backup %s backup no-check\n", i+1, n)
			} else {
				fmt.Fprintf(&servers, "    server node-%d %s\n", i+1, n)
			}
		}
		first := true
		cfg = lines.ReplaceAllStringFunc(cfg, func(string) string {
			if first {
				first = false
				return servers.String()
			}
			return ""
		})
	}
	p := filepath.Join(t.TempDir(), "haproxy.cfg")
	if err := os.WriteFile(p, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// haproxyServerUp asks haproxy's stats socket, as the README's
// `echo 'show stat' | socat stdio unix:SOCK` does, whether server (of the
// backend switchyard) is UP.
func haproxyServerUp(sock, server string) bool {
	c, err := net.DialTimeout("unix", sock, time.Second)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("show stat\n")); err != nil {
		return false
	}
	out, _ := io.ReadAll(c)
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Split(line, ",")
		if len(f) > 17 && f[0] == "switchyard" && f[1] == server {
			return f[17] == "UP"
		}
	}
	return false
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
	sock := filepath.Join(t.TempDir(), "haproxy.sock")
	out, err := exec.Command(haproxy(t), "-c", "-f", shippedHAProxy(t, "127.0.0.1:1", sock, []string{"127.0.0.1:2"})).CombinedOutput()
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
	fleetBehindHAProxy(t, 3)
}

// Two nodes, rolled exactly as the README's "Restarts and upgrades" says:
// the next node once the balancer says the last one is UP (its stats
// socket, asked as the README asks it). With two nodes a restart leaves
// one in service, and for the moments neither is the shipped config's
// backups take the webhooks: every request 202.
func TestTwoNodesRolledBehindHAProxy(t *testing.T) {
	t.Parallel()
	fleetBehindHAProxy(t, 2)
}

// fleetBehindHAProxy runs n nodes behind the shipped config, restarts
// each in turn under a stream, then kills one: every request 202, each
// delivery stored once.
func fleetBehindHAProxy(t *testing.T, count int) {
	needPostgres(t)
	vhost := newVhost(t)
	dbURL := newPostgresDatabase(t)
	type node struct {
		addr, config string
		cmd          *exec.Cmd
		out          *syncBuffer
	}
	nodes := make([]*node, count)
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
	sock := filepath.Join(t.TempDir(), "haproxy.sock")
	lbOut := started(t, exec.Command(haproxy(t), "-db", "-f", shippedHAProxy(t, front, sock, addrs)))
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
	// back in the balancer (UP on its stats socket, as the README asks
	// it) before the next.
	for i, n := range nodes {
		stopProcess(t, n.cmd, n.out, 30*time.Second)
		if !strings.Contains(n.out.String(), "draining") {
			t.Errorf("node %d did not drain:\n%s", i+1, n.out)
		}
		n.cmd, n.out = startProcess(t, n.config, n.addr)
		eventually(t, 30*time.Second, fmt.Sprintf("node %d back in the balancer", i+1), func() bool {
			return haproxyServerUp(sock, fmt.Sprintf("node-%d", i+1))
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
