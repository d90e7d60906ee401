package main

import (
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// RabbitMQ nodes of the test's own: the installed rabbitmq-server, each
// node with its node name, ports, data directories and an Erlang cookie
// of the test's own, the machine's config files never read. One alone
// (ownRabbit) for a test that does to a broker what only a node of its
// own may suffer (its memory alarm, its max_message_size, its stop_app);
// three joined into one cluster (rabbitCluster), behind Debian's haproxy
// in TCP mode, as a user runs one when one broker is not enough. The
// machine's own node is touched by vhost only.

const rabbitmqServer = "/usr/lib/rabbitmq/bin/rabbitmq-server"

// rabbitNode is one node of a test's cluster.
type rabbitNode struct {
	name       string // node@localhost
	port, dist int
	dir        string
	mu         sync.Mutex
	cmd        *exec.Cmd
	done       chan struct{}
}

// env is the node's environment: its name, ports and directories, a
// cookie of the test's own in HOME, empty config files.
func (n *rabbitNode) env() []string {
	return []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=" + filepath.Join(n.dir, "home"), "LANG=C.UTF-8",
		"RABBITMQ_NODENAME=" + n.name, fmt.Sprintf("RABBITMQ_NODE_PORT=%d", n.port), fmt.Sprintf("RABBITMQ_DIST_PORT=%d", n.dist),
		"RABBITMQ_NODE_IP_ADDRESS=127.0.0.1", "ERL_EPMD_ADDRESS=127.0.0.1",
		"RABBITMQ_MNESIA_BASE=" + filepath.Join(n.dir, "mnesia"), "RABBITMQ_LOG_BASE=" + filepath.Join(n.dir, "log"),
		"RABBITMQ_PID_FILE=" + filepath.Join(n.dir, "pid"), "RABBITMQ_ENABLED_PLUGINS_FILE=" + filepath.Join(n.dir, "plugins"),
		"RABBITMQ_CONF_ENV_FILE=" + filepath.Join(n.dir, "env.conf"), "RABBITMQ_CONFIG_FILE=" + filepath.Join(n.dir, "empty.conf")}
}

// start runs the node in the foreground, its output to its directory.
func (n *rabbitNode) start(t testing.TB) {
	t.Helper()
	out, err := os.OpenFile(filepath.Join(n.dir, "out.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(rabbitmqServer)
	cmd.Env, cmd.Stdout, cmd.Stderr = n.env(), out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // the Erlang VM and its helpers, killed together
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); out.Close(); close(done) }()
	n.mu.Lock()
	n.cmd, n.done = cmd, done
	n.mu.Unlock()
}

// kill sends SIGKILL to the node's whole process group and waits for it.
func (n *rabbitNode) kill() {
	n.mu.Lock()
	cmd, done := n.cmd, n.done
	n.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	<-done
}

// ctl runs rabbitmqctl against the node.
func (n *rabbitNode) ctl(t testing.TB, args ...string) string {
	t.Helper()
	cmd := exec.Command("/usr/lib/rabbitmq/bin/rabbitmqctl", append([]string{"-q", "-n", n.name}, args...)...)
	cmd.Env = n.env()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("rabbitmqctl -n %s %s: %v\n%s", n.name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// answers reports whether the node takes AMQP connections: its own
// process runs and its port answers (another process on the port is not
// the node booted).
func (n *rabbitNode) answers() bool {
	n.mu.Lock()
	done := n.done
	n.mu.Unlock()
	select {
	case <-done:
		return false
	default:
	}
	c, err := net.DialTimeout("tcp", n.addr(), time.Second)
	if err == nil {
		c.Close()
	}
	return err == nil
}

// exited reports whether the node's process has ended.
func (n *rabbitNode) exited() bool {
	n.mu.Lock()
	done := n.done
	n.mu.Unlock()
	select {
	case <-done:
		return true
	default:
		return false
	}
}

// portsGiven are the ports freePort has handed out in this run.
var portsGiven = struct {
	sync.Mutex
	m map[int]bool
}{m: map[int]bool{}}

// freePort is a loopback port nothing listens on now, below the kernel's
// ephemeral range (32768 and up), so no outgoing connection takes it
// before its server binds it, and never handed out twice in one run, so
// two clusters started side by side do not share one. Below 30000, so a
// node's CLI ports (its distribution port + 10000) stay valid.
func freePort(t testing.TB) int {
	t.Helper()
	portsGiven.Lock()
	defer portsGiven.Unlock()
	for range 1000 {
		port := 15000 + rand.IntN(15000)
		if portsGiven.m[port] {
			continue
		}
		ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue
		}
		ln.Close()
		portsGiven.m[port] = true
		return port
	}
	t.Fatal("no free port between 15000 and 30000")
	return 0
}

// newRabbitNode starts a node named name (node@localhost) whose Erlang
// cookie is cookie, on ports and in directories of its own, and kills it
// at the test's end. It skips the test where rabbitmq-server is not
// installed.
func newRabbitNode(t testing.TB, name, cookie string) *rabbitNode {
	t.Helper()
	if _, err := os.Stat(rabbitmqServer); err != nil {
		t.Skipf("no %s: the test needs Debian's rabbitmq-server installed for a node of its own", rabbitmqServer)
	}
	n := &rabbitNode{name: name, port: freePort(t), dist: freePort(t), dir: t.TempDir()}
	for _, d := range []string{"home", "mnesia", "log"} {
		if err := os.MkdirAll(filepath.Join(n.dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"plugins", "env.conf", "empty.conf"} {
		if err := os.WriteFile(filepath.Join(n.dir, f), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(n.dir, "home", ".erlang.cookie"), []byte(cookie), 0o400); err != nil {
		t.Fatal(err)
	}
	n.start(t)
	t.Cleanup(n.kill)
	return n
}

// newCookie is an Erlang cookie of the test's own.
func newCookie() string { return "SWITCHYARDTEST" + strings.ToUpper(randHex(8)) }

// booted waits until n takes AMQP connections, and fails the test should
// it exit first.
func (n *rabbitNode) booted(t testing.TB) {
	t.Helper()
	eventually(t, 2*time.Minute, "RabbitMQ node "+n.name+" booted", func() bool {
		if n.exited() {
			out, _ := os.ReadFile(filepath.Join(n.dir, "out.log"))
			t.Fatalf("RabbitMQ node %s exited while booting:\n%s", n.name, out)
		}
		return n.answers()
	})
}

// addr is where n takes AMQP connections; url is its default vhost's.
func (n *rabbitNode) addr() string { return fmt.Sprintf("127.0.0.1:%d", n.port) }
func (n *rabbitNode) url() string  { return guestURL(n.addr()) }

// guestURL is the default vhost of a node of the test's own at addr (or
// of a proxy or balancer in front of it), as guest, whom a node lets in
// from loopback.
func guestURL(addr string) string { return "amqp://guest:guest@" + addr + "/" }

// ownRabbit is a booted node of the test's own, alone, killed at the
// test's end. The nodes boot one at a time (rabbitBoots): a boot takes
// both cores for seconds, and four at once, as the tests that need one
// start together, slowed every test beside them past its waits.
func ownRabbit(t testing.TB) *rabbitNode {
	t.Helper()
	rabbitBoots <- struct{}{}
	defer func() { <-rabbitBoots }()
	n := newRabbitNode(t, "sy"+randHex(4)+"@localhost", newCookie())
	n.booted(t)
	return n
}

// rabbitBoots holds one node's boot at a time (ownRabbit).
var rabbitBoots = make(chan struct{}, 1)

// rabbitCluster starts three nodes, joins the second and third to the
// first, and stops them all at the test's end.
func rabbitCluster(t *testing.T) []*rabbitNode {
	t.Helper()
	cookie, prefix := newCookie(), "sy"+randHex(3)
	nodes := make([]*rabbitNode, 3)
	for i := range nodes {
		nodes[i] = newRabbitNode(t, fmt.Sprintf("%s-%d@localhost", prefix, i+1), cookie)
	}
	for _, n := range nodes {
		n.booted(t)
	}
	for _, n := range nodes[1:] {
		n.ctl(t, "stop_app")
		n.ctl(t, "join_cluster", nodes[0].name)
		n.ctl(t, "start_app")
	}
	if out := nodes[0].ctl(t, "cluster_status"); strings.Count(out, "@localhost") < 3 {
		t.Fatalf("the cluster did not form:\n%s", out)
	}
	return nodes
}

// tcpBalancer runs haproxy in TCP mode on a port of its own in front of
// the nodes, checking each every 500 ms, and returns its address.
func tcpBalancer(t *testing.T, nodes []*rabbitNode) string {
	t.Helper()
	front := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	var b strings.Builder
	fmt.Fprintf(&b, `global
    log stderr format short local0 notice
defaults
    mode tcp
    timeout connect 2s
    timeout client 1m
    timeout server 1m
frontend amqp
    bind %s
    default_backend rabbits
backend rabbits
    balance roundrobin
`, front)
	for i, n := range nodes {
		fmt.Fprintf(&b, "    server rabbit-%d %s check inter 500ms fall 2 rise 2\n", i+1, n.addr())
	}
	cfg := filepath.Join(t.TempDir(), "haproxy.cfg")
	if err := os.WriteFile(cfg, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(haproxy(t), "-db", "-f", cfg)
	out := started(t, cmd)
	eventually(t, 20*time.Second, "haproxy listening", func() bool {
		c, err := net.DialTimeout("tcp", front, time.Second)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("haproxy:\n%s", out)
		}
	})
	return front
}

// leaderOf is the node (of nodes) leading the quorum queue in vhost, as
// a live node tells it.
func leaderOf(t *testing.T, nodes []*rabbitNode, ask *rabbitNode, vhost, queue string) *rabbitNode {
	t.Helper()
	for _, line := range strings.Split(ask.ctl(t, "list_queues", "-p", vhost, "name", "leader"), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[0] == queue {
			for _, n := range nodes {
				if n.name == f[1] {
					return n
				}
			}
		}
	}
	t.Fatalf("no leader of %s in vhost %s", queue, vhost)
	return nil
}

// Three RabbitMQ nodes in a cluster, every queue a quorum queue with
// members on all three, behind haproxy in TCP mode; under a stream of
// 40 webhooks a second the node leading github is SIGKILLed, then
// another node stopped (the queues lose their quorum: nothing is
// confirmed until it starts again): every request is answered 202, and
// every webhook stored once.
func TestOutboxClusterNodesLost(t *testing.T) {
	t.Parallel()
	onBothStores(t, testOutboxClusterNodesLost)
}

func testOutboxClusterNodesLost(t *testing.T) {
	nodes := rabbitCluster(t)
	front := tcpBalancer(t, nodes)
	cfg := testConfig(t, guestURL(front))
	cfg.Queue.Type = "quorum"
	cfg.Log.Level = "info"
	d := startDaemon(t, cfg)
	eventually(t, time.Minute, "the daemon ready", func() bool { return answersOK(d.URL + "/readyz") })
	stop := openLoop(t, func() string { return d.URL }, 25*time.Millisecond)
	answered := func() float64 {
		m := scrape(t, d.URL+"/metrics")
		return m[`switchyard_webhooks_received_total{outcome="accepted"}`] + m[`switchyard_webhooks_received_total{outcome="published"}`] +
			m[`switchyard_webhooks_received_total{outcome="unavailable"}`]
	}
	more := func(what string, n float64) {
		t.Helper()
		from := answered()
		eventually(t, 2*time.Minute, what, func() bool { return answered() >= from+n })
	}
	more("webhooks before the kill", 80)

	leader := leaderOf(t, nodes, nodes[0], "/", queueGitHub)
	leader.kill()
	more("webhooks after the leader's kill", 200)

	var other *rabbitNode
	for _, n := range nodes {
		if n != leader {
			other = n
			break
		}
	}
	other.ctl(t, "stop_app")
	more("webhooks while one node of three runs", 200)
	if n := scrape(t, d.URL+"/metrics")["switchyard_outbox_messages"]; n == 0 {
		t.Log("nothing waited in the outbox with one node of three running")
	}
	other.ctl(t, "start_app")
	more("webhooks after the node came back", 80)
	answers := stop()
	allAnswered202(t, answers)
	guids := make([]string, 0, len(answers))
	for _, a := range answers {
		if a.code == http.StatusAccepted {
			guids = append(guids, a.guid)
		}
	}
	storedAll(t, cfg.Database, guids, 3*time.Minute)
	db := openStoreDB(t, cfg.Database)
	if n := queryInt(t, db, "SELECT count(*) - count(DISTINCT delivery_id) FROM github"); n != 0 {
		t.Errorf("%d webhooks stored more than once", n)
	}
}
