package main

import (
	"strings"
	"testing"
	"time"
)

// queueExists reports whether queue is declared on vhost.
func queueExists(t testing.TB, vhost, queue string) bool {
	t.Helper()
	ch := amqpChannel(t, vhost)
	defer ch.Close()
	_, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	return err == nil
}

// A queue deleted on a spare broker is back within one keepalive, with a
// warning; the depth gauges show a message put on the spare's -error queue;
// every broker's up and info gauges, the build info, and counters at 0
// before anything happened.
func TestKeepaliveAndGauges(t *testing.T) {
	t.Parallel()
	a, spare, gone := newVhost(t), newVhost(t), newVhost(t)
	down := newTCPProxy(t, testBrokerAddr())
	cfg := testConfig(t, amqpURL(a), amqpURL(spare), down.URL(gone))
	cfg.Queue.KeepaliveEvery = 300 * time.Millisecond
	down.Close() // the third broker cannot be reached
	d := startDaemon(t, cfg)

	m := scrape(t, d.URL+"/metrics")
	for _, series := range []string{`switchyard_webhooks_received_total{outcome="unavailable"}`,
		`switchyard_messages_consumed_total{outcome="error",queue="github"}`, `switchyard_switches_completed_total{reason="drained"}`,
		`switchyard_publishes_total{broker="1",outcome="failed"}`} {
		if v, ok := m[series]; !ok || v != 0 {
			t.Errorf("%s: %v (present %v), want 0 from the start", series, v, ok)
		}
	}
	var build, info bool
	for k := range m {
		build = build || strings.HasPrefix(k, `switchyard_build_info{goversion="go`)
		info = info || strings.HasPrefix(k, `switchyard_broker_info{broker="1",host="127.0.0.1"`) && strings.HasSuffix(k, `vhost="`+spare+`"}`)
	}
	if !info {
		t.Errorf("switchyard_broker_info lacks the spare broker")
	}
	if !build {
		t.Errorf("switchyard_build_info missing")
	}

	// An -error queue: no worker reads it, so only the keepalive can notice
	// it is gone (a queue the workers drain comes back with their reconnect
	// too).
	deleted := errorQueue(queueDatabase)
	eventually(t, 30*time.Second, "the spare's topology declared", func() bool { return queueExists(t, spare, deleted) })
	ch := amqpChannel(t, spare)
	defer ch.Close()
	del := func() {
		if _, err := ch.QueueDelete(deleted, false, false, false); err != nil {
			t.Fatal(err)
		}
	}
	del()
	// A keepalive that read the queues just before the delete declares the
	// topology after it, and puts the queue back without having seen it
	// missing: then it is deleted again, for the next keepalive to see.
	eventually(t, 30*time.Second, "the warning", func() bool {
		if strings.Contains(d.logs.String(), `msg="queues were missing on the broker, declared again" worker=keepalive broker="#1`) &&
			strings.Contains(d.logs.String(), "missing=["+deleted+"]") {
			return true
		}
		if queueExists(t, spare, deleted) {
			del()
		}
		return false
	})
	eventually(t, 30*time.Second, "the deleted queue back on the spare", func() bool { return queueExists(t, spare, deleted) })

	publishRaw(t, spare, "", errorQueue(queueGitHub), eventMessage("issues", newGUID(), loadFixture(t, "issues", "opened")))
	eventually(t, 30*time.Second, "the spare's -error depth in the gauges", func() bool {
		return scrape(t, d.URL+"/metrics")[`switchyard_queue_messages{broker="1",queue="github-error"}`] == 1
	})
	m = scrape(t, d.URL+"/metrics")
	if m[`switchyard_broker_up{broker="0"}`] != 1 || m[`switchyard_broker_up{broker="1"}`] != 1 {
		t.Errorf("broker_up of the reachable brokers: %v, %v", m[`switchyard_broker_up{broker="0"}`], m[`switchyard_broker_up{broker="1"}`])
	}
	if v, ok := m[`switchyard_broker_up{broker="2"}`]; !ok || v != 0 {
		t.Errorf("broker_up of the unreachable broker: %v (present %v), want 0", v, ok)
	}
	if _, ok := m[`switchyard_queue_messages{broker="2",queue="github"}`]; ok {
		t.Errorf("the unreachable broker shows queue depths")
	}
	for _, q := range allQueues() {
		if _, ok := m[`switchyard_queue_messages{broker="1",queue="`+q+`"}`]; !ok {
			t.Errorf("no depth gauge for %s on the spare", q)
		}
	}
}

// With declare_topology off, a missing queue is a warning at every keepalive,
// and nothing is declared.
func TestKeepaliveWithoutDeclaring(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	declareTestTopology(t, vhost, 200*time.Millisecond)
	ch := amqpChannel(t, vhost)
	if _, err := ch.QueueDelete(errorQueue(queueHooks), false, false, false); err != nil {
		t.Fatal(err)
	}
	ch.Close()
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Queue.DeclareTopology = false
	cfg.Queue.KeepaliveEvery = 200 * time.Millisecond
	d := startDaemon(t, cfg)
	logged(t, d.logs, "queues missing on the broker, and declare_topology is off", 3)
	if queueExists(t, vhost, errorQueue(queueHooks)) {
		t.Errorf("%s declared with declare_topology off", errorQueue(queueHooks))
	}
}
