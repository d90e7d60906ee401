package main

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// socketServe starts `switchyard serve` as systemd starts a socket-activated
// service: the listening socket f as fd 3, LISTEN_FDS=1, LISTEN_FDNAMES=listen
// and the process's own pid in LISTEN_PID (the shell's, which exec keeps).
func socketServe(t testing.TB, config string, f *os.File) (*exec.Cmd, *syncBuffer) {
	t.Helper()
	cmd := exec.Command("/bin/sh", "-c", `LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=listen exec "$0" serve -config "$1"`,
		builtBinary(t), config)
	cmd.ExtraFiles = []*os.File{f}
	return cmd, started(t, cmd)
}

// answer is one webhook's answer in a stream: its delivery, the status (0
// when the request failed) and when the answer came.
type answer struct {
	guid string
	code int
	err  error
	at   time.Time
}

// webhookStream sends signed webhooks from senders goroutines, each on a
// new connection with GitHub's 10 s timeout, one every every per sender,
// until stop is closed; answers returns what came back so far.
func webhookStream(t testing.TB, url string, body []byte, senders int, every time.Duration) (stop func(), answers func() []answer) {
	var mu sync.Mutex
	var got []answer
	done := make(chan struct{})
	var wg sync.WaitGroup
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	for range senders {
		wg.Go(func() {
			tick := time.NewTicker(every)
			defer tick.Stop()
			for {
				select {
				case <-done:
					return
				case <-tick.C:
				}
				guid := newGUID()
				a := answer{guid: guid}
				resp, err := client.Do(webhookRequest(t, url, "issues", guid, body))
				if err != nil {
					a.err = err
				} else {
					a.code = resp.StatusCode
					resp.Body.Close()
				}
				a.at = time.Now()
				mu.Lock()
				got = append(got, a)
				mu.Unlock()
			}
		})
	}
	stop = func() { close(done); wg.Wait() }
	answers = func() []answer {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(got)
	}
	return stop, answers
}

// restartsUnderStream runs serve on a socket the test holds, as systemd
// does, restarts it restarts times under a steady stream of webhooks,
// and returns every answer, the database (once every delivery answered
// 202 is stored, or the wait for it failed the test) and each restart's gap: from
// the last webhook answered by the old process to the first answered by
// the new one.
func restartsUnderStream(t testing.TB, restarts int, body []byte) (answers []answer, dbPath string, gaps []time.Duration) {
	t.Helper()
	vhost := newVhost(t)
	dir := t.TempDir()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	f, err := ln.File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	addr := ln.Addr().String()
	dbPath = filepath.Join(dir, "switchyard.db")
	config := writeConfig(t, dir, addr, dbPath, amqpURL(vhost))
	cmd, out := socketServe(t, config, f)

	stop, got := webhookStream(t, "http://"+addr, body, 4, 25*time.Millisecond)
	accepted := func() int {
		n := 0
		for _, a := range got() {
			if a.code == http.StatusAccepted {
				n++
			}
		}
		return n
	}
	var exits []time.Time
	for i := 0; i <= restarts; i++ {
		before := accepted()
		eventually(t, 30*time.Second, "webhooks answered by the new process", func() bool { return accepted() >= before+40 })
		if i == restarts {
			break
		}
		if !strings.Contains(out.String(), "listening on the socket systemd passed") {
			t.Errorf("serve does not say it uses the socket systemd passed:\n%s", out)
		}
		stopProcess(t, cmd, out, 30*time.Second)
		exits = append(exits, time.Now())
		cmd, out = socketServe(t, config, f)
	}
	stop()
	answers = got()
	db := openDB(t, dbPath)
	eventually(t, 60*time.Second, "every delivery answered 202 stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github") >= accepted()
	})
	stopProcess(t, cmd, out, 30*time.Second)
	slices.SortFunc(answers, func(a, b answer) int { return a.at.Compare(b.at) })
	for _, exit := range exits {
		i := slices.IndexFunc(answers, func(a answer) bool { return a.at.After(exit) })
		if i > 0 {
			gaps = append(gaps, answers[i].at.Sub(answers[i-1].at))
		}
	}
	return answers, dbPath, gaps
}

// serve on a socket systemd passes, restarted three times under a steady
// stream of webhooks: every request answered 202, none refused, each
// delivery stored once.
func TestSocketActivationRestartsRefuseNothing(t *testing.T) {
	t.Parallel()
	answers, dbPath, gaps := restartsUnderStream(t, 3, loadFixture(t, "issues", "opened"))
	allAccepted(t, answers, "through 3 restarts")
	t.Logf("%d webhooks, all 202; restart gaps %v", len(answers), gaps)
	db := openDB(t, dbPath)
	if n, distinct := queryInt(t, db, "SELECT count(*) FROM github"), queryInt(t, db, "SELECT count(DISTINCT delivery_id) FROM github"); n != len(answers) || distinct != n {
		t.Errorf("github holds %d rows of %d deliveries, want each of the %d once", n, distinct, len(answers))
	}
}

// A socket systemd passes that serve cannot serve is a clear error: one
// not listening for TCP, two without the name "listen".
func TestPassedSocketRefused(t *testing.T) {
	t.Parallel()
	named := func(t *testing.T, fd uintptr, name string) *os.File {
		dup, err := syscall.Dup(int(fd))
		if err != nil {
			t.Fatal(err)
		}
		return os.NewFile(uintptr(dup), name)
	}
	udp, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer udp.Close()
	uf, _ := udp.(*net.UDPConn).File()
	defer uf.Close()
	if _, err := passedListeners([]*os.File{named(t, uf.Fd(), "listen")}, listenFDName); err == nil || !strings.Contains(err.Error(), "not a listening stream socket") {
		t.Errorf("a UDP socket: %v", err)
	}
	var files []*os.File
	for range 2 {
		ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		f, _ := ln.File()
		defer f.Close()
		files = append(files, f)
	}
	two := []*os.File{named(t, files[0].Fd(), "LISTEN_FD_3"), named(t, files[1].Fd(), "metrics")}
	if _, err := passedListeners(two, listenFDName); err == nil || !strings.Contains(err.Error(), `none named "listen"`) {
		t.Errorf("two sockets without a listen name: %v", err)
	}
	// The one named listen among two, or the only one, is taken.
	for _, fs := range [][]*os.File{
		{named(t, files[0].Fd(), "metrics"), named(t, files[1].Fd(), "listen")},
		{named(t, files[1].Fd(), "LISTEN_FD_3")},
	} {
		passed, err := passedListeners(fs, listenFDName)
		if err != nil {
			t.Fatal(err)
		}
		ln := passed[listenFDName]
		want, _ := net.FileListener(files[1])
		if ln.Addr().String() != want.Addr().String() {
			t.Errorf("took %s, want %s", ln.Addr(), want.Addr())
		}
		want.Close()
		ln.Close()
	}
	// serve itself exits 1 naming the socket, before it touches a database.
	dir := t.TempDir()
	config := writeConfig(t, dir, freeAddr(t), filepath.Join(dir, "sy.db"), amqpURL("unused"))
	cmd, out := socketServe(t, config, uf)
	err = cmd.Wait()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(out.String(), "not a listening stream socket") {
		t.Errorf("serve on a UDP socket: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(dir, "sy.db")); err == nil {
		t.Error("serve on a UDP socket created its database")
	}
}

// On SIGTERM with server.drain_delay, /readyz answers 503 "draining" at
// once while webhooks are still taken and stored, and the status says the
// node drains; then the process stops within shutdown_timeout.
func TestDrainDelay(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	dir := t.TempDir()
	addr := freeAddr(t)
	dbPath := filepath.Join(dir, "switchyard.db")
	config := writeConfigWith(t, dir, addr, fmt.Sprintf("path = %q", dbPath),
		"drain_delay = \"10s\"\nshutdown_timeout = \"15s\"", amqpURL(vhost))
	cmd, out := startProcess(t, config, addr)
	readyz := func() (int, string) { return do(t, httpRequest(t, http.MethodGet, "http://"+addr+"/readyz", "", "")) }
	eventually(t, 20*time.Second, "/readyz ready", func() bool { code, _ := readyz(); return code == http.StatusOK })
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	eventually(t, 5*time.Second, "/readyz draining", func() bool {
		code, body := readyz()
		return code == http.StatusServiceUnavailable && strings.Contains(body, `"status":"draining"`)
	})
	guid := newGUID()
	code := postWebhook(t, "http://"+addr, "issues", guid, loadFixture(t, "issues", "opened"))
	_, status := do(t, httpRequest(t, http.MethodGet, "http://"+addr+"/api/v1/status", "", "operator-token-for-tests"))
	pageReq := httpRequest(t, http.MethodGet, "http://"+addr+"/status", "", "")
	pageReq.SetBasicAuth("operator", "operator-token-for-tests")
	_, page := do(t, pageReq)
	db := openDB(t, dbPath)
	stored := false
	eventually(t, 8*time.Second, "the webhook taken while draining stored", func() bool {
		stored = queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid) == 1
		return stored
	})
	// All of that while the node still drained.
	if c, body := readyz(); c != http.StatusServiceUnavailable || !strings.Contains(body, "draining") {
		t.Fatalf("the drain ended before the checks: /readyz %d %s", c, body)
	}
	if code != http.StatusAccepted {
		t.Errorf("a webhook while draining: %d, want 202", code)
	}
	if !strings.Contains(page, `id="draining"`) {
		t.Errorf("the status page does not show a draining node:\n%s", page)
	}
	if !strings.Contains(status, `"draining":true`) {
		t.Errorf("the status does not show a draining node: %s", status)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("exit after the drain: %v\n%s", err, out)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("still running 20 s after SIGTERM\n%s", out)
	}
	if !strings.Contains(out.String(), "draining") {
		t.Errorf("the log does not say the node drains:\n%s", out)
	}
}

// allAccepted fails the test, naming the first few, unless every answer
// is a 202.
func allAccepted(t testing.TB, answers []answer, what string) {
	t.Helper()
	bad := 0
	for _, a := range answers {
		if a.code != http.StatusAccepted {
			if bad++; bad <= 10 {
				t.Errorf("delivery %s: status %d, error %v", a.guid, a.code, a.err)
			}
		}
	}
	if bad > 0 {
		t.Fatalf("%d of %d webhooks not answered 202 %s", bad, len(answers), what)
	}
}

// A passed socket is server.listen's when their addresses agree, a host
// name or an empty host standing for what it names; else serve warns.
func TestSameAddr(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		socket, listen string
		same           bool
	}{
		{"127.0.0.1:8080", "127.0.0.1:8080", true},
		{"127.0.0.1:8080", "localhost:8080", true},
		{"0.0.0.0:8080", ":8080", true},
		{"[::]:8080", "0.0.0.0:8080", true},
		{"127.0.0.1:8081", "127.0.0.1:8080", false},
		{"10.0.0.1:8080", "127.0.0.1:8080", false},
		{"127.0.0.1:8080", ":8080", false},
	} {
		if got := sameAddr(c.socket, c.listen); got != c.same {
			t.Errorf("sameAddr(%q, %q) = %v, want %v", c.socket, c.listen, got, c.same)
		}
	}
}
