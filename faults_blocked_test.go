package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"
)

// A broker that blocks the connection (RabbitMQ's memory alarm here, as a
// free plan's quota would): a webhook is answered 503 with Retry-After and
// the reason while the block still holds, instead of waiting out
// publish_timeout; the gauge and the status say so; once the alarm clears,
// webhooks are 202 again and nothing accepted is lost. The alarm is a
// node's, so the node is the test's own.
func TestFaultBrokerBlocked(t *testing.T) {
	t.Parallel()
	node := ownRabbit(t)
	proxy := newTCPProxy(t, node.addr())
	cfg := testConfig(t, guestURL(proxy.addr))
	cfg.Queue.OutboxMaxBytes = 1           // the broker's path: the outbox full, each webhook published at the door (outbox_test.go has the outbox)
	cfg.Queue.PublishTimeout = time.Minute // a 503 before this is the block's, not the timeout's
	// A blocked connection reads nothing: the workers' calls on it wait
	// until call_timeout, which then closes it. Longer than the checks
	// below take on a loaded machine; the close is the proxy's Cut.
	cfg.Queue.CallTimeout = time.Minute
	cfg.Log.Level = "info"
	pushed := alertOnBlock(t, cfg)
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	before := newGUID()
	if code := postWebhook(t, d.URL, "issues", before, body); code != http.StatusAccepted {
		t.Fatalf("before the alarm: %d", code)
	}

	node.ctl(t, "set_vm_memory_high_watermark", "0.0000001")
	// RabbitMQ blocks a connection, and says so, when it next publishes:
	// this webhook's publish is what the block stops.
	code, answer := do(t, webhookRequest(t, d.URL, "issues", newGUID(), body))
	stillBlocked := scrape(t, d.URL+"/metrics")[`switchyard_broker_blocked{broker="0"}`] == 1
	if code != http.StatusServiceUnavailable || !strings.Contains(answer, "blocked") || !stillBlocked {
		t.Errorf("a webhook while the broker blocks: %d %s (block still on: %v), want 503 naming the block while it holds", code, answer, stillBlocked)
	}
	// It was sent: it may still reach the queue once the block ends.
	if !strings.Contains(answer, "not confirmed") || strings.Contains(answer, "not queued") {
		t.Errorf("a webhook sent, then blocked: %s, want it told \"not confirmed\"", answer)
	}
	// The next one is refused before it is sent.
	if code, answer := do(t, webhookRequest(t, d.URL, "issues", newGUID(), body)); code != http.StatusServiceUnavailable ||
		!strings.Contains(answer, "blocked") || !strings.Contains(answer, "not queued") {
		t.Errorf("a second webhook while the broker blocks: %d %s, want 503 naming the block, not queued", code, answer)
	}
	req := mustRequestAuth(t, d.URL+"/api/v1/status")
	_, raw := do(t, req)
	var st Status
	if err := json.Unmarshal([]byte(raw), &st); err != nil || len(st.Brokers) != 1 || st.Brokers[0].Blocked == "" {
		t.Errorf("the status while blocked: %v %+v, want broker #0 blocked", err, st.Brokers)
	}
	// One alert for the block, however often the budget checks while it holds.
	db := openStoreDB(t, cfg.Database)
	for range 3 {
		if err := d.usage.flushAndCheck(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if n := queryInt(t, db, "SELECT count(*) FROM alert_outbox WHERE delivery_id LIKE 'blocked:%' AND channel = 'push'"); n != 1 {
		t.Errorf("alerts of the block: %d, want 1", n)
	}
	select {
	case text := <-pushed:
		if !strings.Contains(text, "Broker blocked") || !strings.Contains(text, "memory") {
			t.Errorf("the block's alert reads:\n%s\nwant it to name the block and its reason", text)
		}
	case <-time.After(30 * time.Second):
		t.Error("the block's alert was not sent")
	}

	// The connection closed under the block (as call_timeout closes it):
	// the next connection, blocked at its first publish, goes on with the
	// same block, alerted once.
	proxy.Cut()
	eventually(t, 30*time.Second, "the next connection blocked", func() bool {
		if code, answer := do(t, webhookRequest(t, d.URL, "issues", newGUID(), body)); code != http.StatusServiceUnavailable ||
			!strings.Contains(answer, "blocked") {
			t.Errorf("a webhook, the broker still blocking: %d %s, want 503 naming the block", code, answer)
		}
		logs := d.logs.String()
		return strings.Contains(logs, "still blocks publishing") || strings.Count(logs, "broker blocks publishing") > 1
	})
	for range 3 {
		if err := d.usage.flushAndCheck(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if n := queryInt(t, db, "SELECT count(*) FROM alert_outbox WHERE delivery_id LIKE 'blocked:%' AND channel = 'push'"); n != 1 {
		t.Errorf("alerts of the block, after its connection closed: %d, want 1", n)
	}
	if !strings.Contains(d.logs.String(), "still blocks publishing") {
		t.Error("the log does not say the block goes on on the new connection")
	}

	node.ctl(t, "set_vm_memory_high_watermark", "0.4")
	eventually(t, 60*time.Second, "webhooks accepted again", func() bool {
		return postWebhook(t, d.URL, "issues", newGUID(), body) == http.StatusAccepted
	})
	eventually(t, 60*time.Second, "the delivery accepted before the block stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", before) == 1
	})
	if v := scrape(t, d.URL+"/metrics")[`switchyard_broker_blocked{broker="0"}`]; v != 0 {
		t.Errorf("switchyard_broker_blocked after the alarm cleared: %v, want 0", v)
	}
}

// alertOnBlock sends cfg's "blocked" alerts to a push server of the test's,
// whose channel has each alert's title and text.
func alertOnBlock(t *testing.T, cfg *Config) <-chan string {
	pushed := make(chan string, 10)
	push := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		pushed <- r.Header.Get("Title") + "\n" + string(body)
	}))
	t.Cleanup(push.Close)
	cfg.Alerts = AlertsConfig{Rules: []AlertRule{{Events: []string{"blocked"}, Channels: []string{"push"}}},
		Push: PushConfig{URL: push.URL}}
	return pushed
}

// A broker that refuses publishes without blocking the connection (here a
// queue policy, overflow reject-publish: the confirm comes as a nack; LavinMQ
// low on disk closes the channel with 406 instead) is blocked, not
// unreachable: without the spool the webhook gets 503 naming the refusal
// once publish_timeout is over (its publish sent again until then), the
// gauge and the status say so, one alert goes out, and the first
// confirmed publish after the policy is cleared ends it.
func TestFaultBrokerRefuses(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Queue.OutboxMaxBytes = 1 // the broker's path: the outbox full, each webhook published at the door (outbox_test.go has the outbox)
	// A nacked publish is sent again while publish_timeout lasts (a
	// quorum queue electing its leader nacks for a moment): the 503
	// comes at its end, naming the refusal.
	cfg.Queue.PublishTimeout = 2 * time.Second
	pushed := alertOnBlock(t, cfg)
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Fatalf("before the policy: %d", code)
	}
	rabbitmqctl(t, "set_policy", "-p", vhost, "--apply-to", "queues", "refuse", "^github$", `{"max-length":0,"overflow":"reject-publish"}`)
	var code int
	var answer string
	eventually(t, 30*time.Second, "the policy in force", func() bool {
		code, answer = do(t, webhookRequest(t, d.URL, "issues", newGUID(), body))
		return code != http.StatusAccepted
	})
	gauge := scrape(t, d.URL+"/metrics")[`switchyard_broker_blocked{broker="0"}`]
	if code != http.StatusServiceUnavailable || !strings.Contains(answer, "broker refusing publishes") || gauge != 1 {
		t.Errorf("a webhook the broker refuses: %d %s, gauge %v; want 503 naming the refusal, gauge 1", code, answer, gauge)
	}
	b := d.brokers.List()[0]
	if strings.Contains(answer, b.Host) || strings.Contains(answer, vhost) {
		t.Errorf("the 503 names where the broker is: %s", answer)
	}
	_, raw := do(t, mustRequestAuth(t, d.URL+"/api/v1/status"))
	var st Status
	if err := json.Unmarshal([]byte(raw), &st); err != nil || len(st.Brokers) != 1 || !strings.Contains(st.Brokers[0].Blocked, "nack") {
		t.Errorf("the status while refusing: %v %+v, want broker #0 blocked by the refusal", err, st.Brokers)
	}
	for range 3 {
		if err := d.usage.flushAndCheck(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	db := openStoreDB(t, cfg.Database)
	if n := queryInt(t, db, "SELECT count(*) FROM alert_outbox WHERE delivery_id LIKE 'blocked:%' AND channel = 'push'"); n != 1 {
		t.Errorf("alerts of the refusal: %d, want 1", n)
	}
	select {
	case text := <-pushed:
		if !strings.Contains(text, "Broker blocked") {
			t.Errorf("the refusal's alert reads:\n%s\nwant it to name the block", text)
		}
	case <-time.After(30 * time.Second):
		t.Error("the refusal's alert was not sent")
	}

	rabbitmqctl(t, "clear_policy", "-p", vhost, "refuse")
	eventually(t, 30*time.Second, "webhooks accepted again", func() bool {
		return postWebhook(t, d.URL, "issues", newGUID(), body) == http.StatusAccepted
	})
	if v := scrape(t, d.URL+"/metrics")[`switchyard_broker_blocked{broker="0"}`]; v != 0 {
		t.Errorf("switchyard_broker_blocked after a confirmed publish: %v, want 0", v)
	}
}

// largeIssue is an issues webhook of about size bytes, mostly an issue
// body of random hex, which compresses as much as real text does or less.
func largeIssue(t testing.TB, size int) []byte {
	t.Helper()
	return mutate(t, loadFixture(t, "issues", "opened"), func(p map[string]any) {
		obj(p, "issue")["body"] = randHex(size / 2)
	})
}

// RabbitMQ 4 takes messages up to 16 MiB; GitHub sends payloads up to
// 25 MB. A 20 MiB webhook goes compressed and is stored whole under a
// broker whose max_message_size is 16 MiB; with compression off it is
// answered 413 before anything is published; and a broker whose limit is
// below max_message_bytes closes the channel (406), which is a refusal,
// not an unreachable broker. max_message_size is the node's, so the node
// is the test's own.
func TestLargeWebhookUnderBrokerLimit(t *testing.T) {
	t.Parallel()
	node := ownRabbit(t)
	node.ctl(t, "eval", "application:set_env(rabbit, max_message_size, 16777216).")

	body := largeIssue(t, 20<<20)
	cfg := testConfig(t, node.url())
	// 20 MiB takes its time to compress and cross, and the workers' calls
	// on the one connection wait behind its frames: on a loaded machine,
	// longer than the 3 s of testConfig, whose timeout would close the
	// connection under the publish, again and again.
	cfg.Queue.PublishTimeout = 30 * time.Second
	cfg.Queue.CallTimeout = 30 * time.Second
	// A race-built daemon on a loaded machine takes a minute or more over
	// 20 MiB of JSON (alone, seconds): each wait for it to be stored is
	// three.
	const stored = 3 * time.Minute
	d := startDaemon(t, cfg)
	guid := newGUID()
	if code, answer := do(t, webhookRequest(t, d.URL, "issues", guid, body)); code != http.StatusAccepted {
		t.Fatalf("a 20 MiB webhook, compressed: %d %s, want 202", code, answer)
	}
	db := openStoreDB(t, cfg.Database)
	eventually(t, stored, "the 20 MiB webhook stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid) == 1
	})
	if got := storedPayload(t, d.store, guid); got != string(body) {
		t.Errorf("stored payload: %d bytes, want %d, whole", len(got), len(body))
	}
	d.stop(t)

	// Compression off: 413 before publishing, the delivery named in the log.
	cfg.Queue.Compress, cfg.Queue.CompressOver = "none", 0
	d = startDaemon(t, cfg)
	tooLarge := newGUID()
	if code, answer := do(t, webhookRequest(t, d.URL, "issues", tooLarge, body)); code != http.StatusRequestEntityTooLarge ||
		!strings.Contains(answer, "max_message_bytes") {
		t.Errorf("a 20 MiB webhook, not compressed: %d %s, want 413 naming max_message_bytes", code, answer)
	}
	if !strings.Contains(d.logs.String(), tooLarge) {
		t.Errorf("no log line names the delivery refused as too large")
	}
	d.stop(t)

	// A broker limit below max_message_bytes: the broker closes the
	// channel, and says why. The webhook was committed (202 queued); its
	// row is kept as refused for good, the status names it, the webhooks
	// behind it go on; once the operator raised the broker's limit,
	// switchyard outbox retry sends it again, and it is stored. From here
	// on 2 MiB over a limit of 1 MiB: the same refusal, a tenth of the
	// bytes (a loaded machine's race-built daemon took minutes over 20).
	node.ctl(t, "eval", "application:set_env(rabbit, max_message_size, 1048576).")
	over := largeIssue(t, 2<<20)
	cfg.Brokers[0].MaxMessageBytes = 64 << 20
	d = startDaemon(t, cfg)
	refused := newGUID()
	if code, answer := do(t, webhookRequest(t, d.URL, "issues", refused, over)); code != http.StatusAccepted || !strings.Contains(answer, `"queued"`) {
		t.Fatalf("a message over the broker's own limit: %d %s, want 202 queued (the store takes it)", code, answer)
	}
	behind := newGUID()
	if code := postWebhook(t, d.URL, "issues", behind, loadFixture(t, "issues", "opened")); code != http.StatusAccepted {
		t.Errorf("a small webhook behind it: %d, want 202", code)
	}
	storedAll(t, cfg.Database, []string{behind}, stored)
	var st Status
	eventually(t, 30*time.Second, "the refused row in the status", func() bool {
		_, raw := do(t, mustRequestAuth(t, d.URL+"/api/v1/status"))
		st = Status{}
		return json.Unmarshal([]byte(raw), &st) == nil && st.Outbox.RefusedCount == 1
	})
	if r := st.Outbox.Refused[0]; r.GUID != refused || !strings.Contains(r.Reason, "max_message_size") ||
		!strings.Contains(strings.Join(st.Problems, "\n"), "switchyard outbox retry") {
		t.Errorf("the status of the refused webhook: %+v, problems %q", st.Outbox, st.Problems)
	}
	if !strings.Contains(d.logs.String(), "406 PRECONDITION_FAILED") {
		t.Errorf("the log does not say why the broker refused (406)")
	}
	if v := scrape(t, d.URL+"/metrics")["switchyard_outbox_refused"]; v != 1 {
		t.Errorf("switchyard_outbox_refused: %v, want 1", v)
	}
	// The broker's limit raised (channels opened before keep the old
	// one: the daemon restarts, as after a broker's restart), then retry.
	node.ctl(t, "eval", "application:set_env(rabbit, max_message_size, 67108864).")
	d.stop(t)
	var retried bytes.Buffer
	config := writeConfig(t, t.TempDir(), "127.0.0.1:0", cfg.Database.Path, node.url())
	if err := run(context.Background(), []string{"outbox", "-config", config, "retry"}, &retried, &retried); err != nil ||
		!strings.Contains(retried.String(), "1 webhook the broker refused") {
		t.Fatalf("switchyard outbox retry: %v\n%s", err, retried.String())
	}
	d = startDaemon(t, cfg)
	storedAll(t, cfg.Database, []string{refused}, stored)
	d.stop(t)

	// The door's own publishes (the outbox full: the broker's path) share
	// the confirm channels. Those sent behind a message the broker closes
	// a channel on go with it, unconfirmed: they are sent again and
	// answered 202, not 413 for a size they do not have.
	node.ctl(t, "eval", "application:set_env(rabbit, max_message_size, 1048576).")
	proxy := newTCPProxy(t, node.addr())
	wire := proxy.countFrames()
	door := testConfig(t, guestURL(proxy.addr))
	door.Brokers[0].MaxMessageBytes = 64 << 20
	door.Queue.OutboxMaxBytes = 1
	door.Queue.Compress, door.Queue.CompressOver = "none", 0
	door.Queue.PublishTimeout = 30 * time.Second
	door.Queue.CallTimeout = 30 * time.Second
	d = startDaemon(t, door)
	small := loadFixture(t, "issues", "opened")
	post := func(bodies ...[]byte) <-chan sent {
		answers := make(chan sent, len(bodies))
		for i, body := range bodies {
			guid := newGUID()
			req := webhookRequest(t, d.URL, "issues", guid, body)
			go func() {
				code, text, err := doQuiet(http.DefaultClient, req)
				answers <- sent{seq: i, guid: guid, code: code, body: text, err: err}
			}()
		}
		return answers
	}
	smalls := func(n int) [][]byte { return slices.Repeat([][]byte{small}, n) }
	warm := post(smalls(64)...) // every confirm channel open
	for range 64 {
		if a := <-warm; a.code != http.StatusAccepted {
			t.Fatalf("before the stall: %d %s %v", a.code, a.body, a.err)
		}
	}
	proxy.StallReplies(true)
	sentBy := func(n int64) {
		eventually(t, 30*time.Second, fmt.Sprintf("%d publishes on the wire", n), func() bool { return wire.publish.Load() >= n })
	}
	start := wire.publish.Load()
	ahead := post(smalls(16)...)
	sentBy(start + 16)
	large := post(over)
	sentBy(start + 17)
	behindIt := post(smalls(32)...)
	sentBy(start + 17 + 32)
	proxy.StallReplies(false)
	if a := <-large; a.code != http.StatusRequestEntityTooLarge || !strings.Contains(a.body, "max_message_size") {
		t.Errorf("the webhook over the broker's own limit, at the door: %d %s %v, want 413 naming max_message_size", a.code, a.body, a.err)
	}
	var took []string
	for range 48 {
		var a sent
		select {
		case a = <-ahead:
		case a = <-behindIt:
		}
		if a.code != http.StatusAccepted {
			t.Errorf("a small webhook on the confirm channels with it: %d %s %v, want 202", a.code, a.body, a.err)
			continue
		}
		took = append(took, a.guid)
	}
	storedAll(t, door.Database, took, stored)
}

// With rotate_on_budget, a refusal of the publish target that lasts
// blocked_rotate_after counts as a spent budget, as a connection.blocked
// does: switchyard records a Pending Switch to the next broker.
func TestRefusalRotates(t *testing.T) {
	t.Parallel()
	a, b := newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(b))
	cfg.Queue.OutboxMaxBytes = 1 // the broker's path: the outbox full, each webhook published at the door (outbox_test.go has the outbox)
	cfg.Queue.RotateOnBudget, cfg.Queue.BlockedRotateAfter = true, time.Millisecond
	d := startDaemon(t, cfg)
	body := loadFixture(t, "issues", "opened")
	if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Fatalf("before the policy: %d", code)
	}
	rabbitmqctl(t, "set_policy", "-p", a, "--apply-to", "queues", "refuse", "^github$", `{"max-length":0,"overflow":"reject-publish"}`)
	eventually(t, 30*time.Second, "the broker refusing", func() bool {
		return postWebhook(t, d.URL, "issues", newGUID(), body) == http.StatusServiceUnavailable
	})
	var m map[string]any
	eventually(t, 10*time.Second, "a pending switch to broker 1 once the refusal outlasts blocked_rotate_after", func() bool {
		if err := d.usage.flushAndCheck(context.Background()); err != nil {
			t.Fatal(err)
		}
		_, m = apiCall(t, "GET", d.URL+"/api/v1/broker", "operator-token-for-tests", "")
		pending, _ := m["pending_switch"].(map[string]any)
		return pending != nil && pending["index"] == float64(1)
	})
	// The webhook endpoint publishes to the pending target at once.
	if code := postWebhook(t, d.URL, "issues", newGUID(), body); code != http.StatusAccepted {
		t.Errorf("a webhook once the switch is pending: %d, want 202 from broker 1", code)
	}
}
