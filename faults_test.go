package main

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// These tests break things on purpose: connections cut, RabbitMQ stopped,
// the process killed, the broker stalled. Each checks the no-loss promise:
// every delivery GitHub was told was accepted ends up stored exactly once.

// stream sends n deliveries from `clients` concurrent clients. Like GitHub
// redelivering, a client repeats a delivery until it gets a 202 (or deadline
// passes); pause, when set, runs between deliveries of client 0 so that the
// caller can break things mid-stream. It returns the accepted GUIDs.
func stream(t *testing.T, url func() string, n, clients int, deadline time.Duration) []string {
	t.Helper()
	body := loadFixture(t, "pull_request", "synchronize")
	var next atomic.Int64
	var mu sync.Mutex
	var accepted []string
	var wg sync.WaitGroup
	end := time.Now().Add(deadline)
	client := &http.Client{Timeout: 10 * time.Second}
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				guid := newGUID()
				for time.Now().Before(end) {
					resp, err := client.Do(webhookRequest(t, url(), "pull_request", guid, body))
					if err == nil {
						resp.Body.Close()
						if resp.StatusCode == http.StatusAccepted {
							mu.Lock()
							accepted = append(accepted, guid)
							mu.Unlock()
							break
						}
					}
					time.Sleep(50 * time.Millisecond)
				}
			}
		}()
	}
	wg.Wait()
	return accepted
}

// storedExactlyOnce checks that every GUID has exactly one github row and was
// finished once by database-service.
func storedExactlyOnce(t *testing.T, dbPath string, guids []string, timeout time.Duration) {
	t.Helper()
	storedAll(t, DatabaseConfig{Driver: "sqlite", Path: dbPath}, guids, timeout)
	db := openDB(t, dbPath)
	for _, g := range guids {
		if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", g); n != 1 {
			t.Errorf("delivery %s: %d rows, want 1", g, n)
		}
	}
	if n := queryInt(t, db, "SELECT sum(count) FROM github_statistics_6h"); n != queryInt(t, db, "SELECT count(*) FROM github") {
		t.Errorf("statistics count %d rows, github has %d", n, queryInt(t, db, "SELECT count(*) FROM github"))
	}
}

// The broker connection cut 20 times during a stream of 2,000 webhooks or more: every
// delivery stored exactly once, and no goroutine left behind. Not parallel:
// goleak sees every goroutine of the process, other tests' included.
func TestFaultConnectionCuts(t *testing.T) {
	// Registered first, so it runs last: after the daemon, the proxy and the
	// test's own database handles are closed.
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, before) })
	vhost := newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	cfg := testConfig(t, proxy.URL(vhost))
	cfg.Log.Level = "info"
	d := startDaemon(t, cfg)

	var cuts atomic.Int64
	stop, cutting := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(cutting)
		for cuts.Load() < 20 {
			select {
			case <-stop:
				return
			case <-time.After(60 * time.Millisecond):
				proxy.Cut()
				cuts.Add(1)
			}
		}
	}()
	// The stream goes on, in rounds, until all 20 cuts came during it:
	// the door answers from the store, so how long 2,000 take is the
	// disk's, not the broker's.
	var accepted []string
	sent := 0
	for sent < 2000 || cuts.Load() < 20 {
		accepted = append(accepted, stream(t, func() string { return d.URL }, 250, 8, 3*time.Minute)...)
		sent += 250
	}
	close(stop)
	<-cutting
	if len(accepted) != sent {
		t.Fatalf("accepted %d of %d", len(accepted), sent)
	}

	// Both workers came back after the last cut: a webhook sent after it is
	// stored too. How soon depends on the backlog the stream left and on the
	// machine, so the wait is a condition with a generous deadline, not a
	// time bound (a slow machine's backlog outlasted "15 s backoff + 10 s").
	guid := "after-cuts-" + randHex(4)
	if code, body := do(t, webhookRequest(t, d.URL, "pull_request", guid, loadFixture(t, "pull_request", "synchronize"))); code != http.StatusAccepted {
		t.Fatalf("webhook after the cuts: %d %s", code, body)
	}
	storedExactlyOnce(t, cfg.Database.Path, append(accepted, guid), 3*time.Minute)
}

// RabbitMQ itself stopped and started during a stream: 202 queued while it
// is down, and nothing accepted is lost. The node is the test's own: the
// machine's is never stopped.
func TestFaultRabbitMQRestart(t *testing.T) {
	t.Parallel()
	node := ownRabbit(t)
	cfg := testConfig(t, node.url())
	cfg.Log.Level = "info"
	d := startDaemon(t, cfg)

	body := loadFixture(t, "issues", "opened")
	done := make(chan []string)
	go func() { done <- stream(t, func() string { return d.URL }, 600, 4, 3*time.Minute) }()
	db := openStoreDB(t, cfg.Database)
	eventually(t, 30*time.Second, "the stream flowing", func() bool { return queryInt(t, db, "SELECT count(*) FROM github") > 0 })
	node.ctl(t, "stop_app")
	// While it is down: 202 queued in the outbox, and the workers find
	// the broker gone.
	downGUID := newGUID()
	down, downAnswer := do(t, webhookRequest(t, d.URL, "issues", downGUID, body))
	logged(t, d.logs, "cycle failed", 1)
	node.ctl(t, "start_app")
	accepted := <-done
	eventually(t, 60*time.Second, "202 queued once RabbitMQ is back", func() bool {
		_, answer := do(t, webhookRequest(t, d.URL, "issues", newGUID(), body))
		return strings.Contains(answer, `"queued"`)
	})
	if down != http.StatusAccepted || !strings.Contains(downAnswer, `"queued"`) {
		t.Errorf("webhook while RabbitMQ was stopped: got %d %s, want 202 queued", down, downAnswer)
	}
	if len(accepted) != 600 {
		t.Fatalf("accepted %d of 600", len(accepted))
	}
	storedExactlyOnce(t, cfg.Database.Path, append(accepted, downGUID), 2*time.Minute)
}

// switchyard killed with SIGKILL 10 times during a stream and restarted:
// every confirmed webhook ends up stored exactly once.
func TestFaultSIGKILL(t *testing.T) {
	t.Parallel()
	config, addr, dbPath := processSetup(t)
	cmd, out := startProcess(t, config, addr)
	done := make(chan []string)
	go func() { done <- stream(t, func() string { return "http://" + addr }, 1500, 8, 4*time.Minute) }()
	db := openDB(t, dbPath)
	for i := 0; i < 10; i++ {
		// Each life stores something before it is killed.
		before := queryInt(t, db, "SELECT count(*) FROM github")
		eventually(t, 60*time.Second, "a restarted process storing", func() bool {
			return queryInt(t, db, "SELECT count(*) FROM github") > before
		})
		_ = cmd.Process.Signal(syscall.SIGKILL)
		_ = cmd.Wait()
		cmd, out = startProcess(t, config, addr)
	}
	accepted := <-done
	if len(accepted) != 1500 {
		t.Fatalf("accepted %d of 1500\n%s", len(accepted), out)
	}
	storedExactlyOnce(t, dbPath, accepted, 2*time.Minute)
	_ = cmd.Process.Signal(syscall.SIGTERM)
	_ = cmd.Wait()
}

// A broker that accepts connections and then never answers: AMQP calls time
// out, the webhook is answered 202 queued at once (the door waits on the
// store, not the broker), the worker logs and moves on, and once the
// broker answers again everything flows, that webhook too.
func TestFaultStalledBroker(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	cfg := testConfig(t, proxy.URL(vhost))
	cfg.Queue.CallTimeout = time.Second
	cfg.Queue.PublishTimeout = time.Second
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Fatalf("before the stall: %d", code)
	}

	proxy.Stall(true)
	// Answered 202 while the stall still holds.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stalled := newGUID()
	code, answer := do(t, webhookRequest(t, d.URL, "issues", stalled, body).WithContext(ctx))
	if code != http.StatusAccepted || !strings.Contains(answer, `"queued"`) || !proxy.isStalled() {
		t.Errorf("stalled broker: got %d %s, want 202 queued while the stall holds", code, answer)
	}
	eventually(t, 20*time.Second, "a worker noticing the stall", func() bool {
		logs := d.logs.String()
		return strings.Contains(logs, "cycle failed") && (strings.Contains(logs, "timed out") || strings.Contains(logs, "i/o timeout"))
	})
	proxy.Stall(false)
	proxy.Cut() // the stalled connections are dead to both sides by now
	guid := newGUID()
	eventually(t, 30*time.Second, "202 after the stall", func() bool {
		return postWebhook(t, d.URL, "issues", guid, body) == http.StatusAccepted
	})
	storedAll(t, cfg.Database, []string{stalled, guid}, 30*time.Second)
}
