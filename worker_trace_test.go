package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The Leftover Drain's and the hooks republish's consumers are spans of
// their deliveries' traces. A message left on a broker that is not the
// active one, carrying an outside producer's trace, is drained in that
// trace, its span marked as the drain's and naming the broker it came
// from. A delivery GitHub failed to deliver is fetched and republished
// under the span of the github-hooks message that named it, and the
// republished message's consumers follow in the same trace, found by the
// delivery's GUID.
func TestTraceOfLeftoverDrainAndRepublish(t *testing.T) {
	t.Parallel()
	otlp, query, jout := startJaeger(t)
	active, other := newVhost(t), newVhost(t)

	declareTestTopology(t, other, 200*time.Millisecond)
	const outside = "5af7183fb1d4cf5f91bc3a2c46e1b0d7"
	left := newGUID()
	msg := eventMessage("issues", left, loadFixture(t, "issues", "opened"))
	msg.Headers["traceparent"] = "00-" + outside + "-00f067aa0ba902b7-01"
	publishRaw(t, other, "", queueGitHub, msg)

	gh := newFakeGitHub(t)
	failed := newGUID()
	gh.add(hookDelivery{ID: 1, GUID: failed, DeliveredAt: time.Now().UTC().Add(-10 * time.Minute), Status: "Service Unavailable",
		StatusCode: 503, Event: "issues", Action: ptr("opened")}, loadFixture(t, "issues", "opened"))

	dir, addr := t.TempDir(), freeAddr(t)
	config := writeConfigWith(t, dir, addr, fmt.Sprintf("path = %q", filepath.Join(dir, "switchyard.db")), "",
		amqpURL(active), amqpURL(other))
	editConfig(t, config, "[github]\n", fmt.Sprintf("[github]\napp_id = %d\nprivate_key_file = %q\napi_url = %q\n", testAppID, gh.keyFile(t), gh.srv.URL))
	editConfig(t, config, "[workers]\n", "[workers]\nhooks_poll_every = \"300ms\"\n")
	appendFile(t, config, fmt.Sprintf("[tracing]\nendpoint = \"http://%s\"\nsample_ratio = 1\n", otlp))
	_, out := startProcess(t, config, addr)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("switchyard:\n%s\njaeger:\n%s", out, jout)
		}
	})

	// The Leftover Drain, in the outside producer's trace.
	var drained jaegerSpan
	eventually(t, 60*time.Second, "the drained message's span in its trace", func() bool {
		tr, ok := traceByID(t, query, outside)
		if !ok {
			return false
		}
		for _, s := range tr.Spans {
			if s.OperationName == "process github" && s.tag("switchyard.leftover_drain") == "true" {
				drained = s
				return true
			}
		}
		return false
	})
	if got, want := drained.tag("switchyard.broker"), "vhost "+other; !strings.HasSuffix(got, want) {
		t.Errorf("the drained message's span names broker %q, want the one it was left on (%s)", got, want)
	}
	if got := drained.tag("messaging.message.id"); got != left {
		t.Errorf("the drained span is of message %q, want %s", got, left)
	}

	// The hooks republish: one trace from the github-hooks message through
	// both consumers of the delivery it republished.
	found := wholeTrace(t, query, failed, []string{"process github-hooks", "publish github-exchange", "process github", "process github-database"})
	hooks, publish := found.span("process github-hooks"), found.span("publish github-exchange")
	if !publish.childOf(hooks.SpanID) {
		t.Errorf("the republish's span is not the github-hooks consumer's child: %+v", publish.References)
	}
	if got := hooks.tag("github.delivery"); got != failed {
		t.Errorf("the github-hooks span names delivery %q, want %s", got, failed)
	}
}

// traceByID is the trace of id in Jaeger at query, once it holds one.
func traceByID(t *testing.T, query, id string) (jaegerTrace, bool) {
	t.Helper()
	resp, err := http.Get("http://" + query + "/api/traces/" + id)
	if err != nil {
		return jaegerTrace{}, false
	}
	defer resp.Body.Close()
	var body struct {
		Data []jaegerTrace `json:"data"`
	}
	if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&body) != nil || len(body.Data) != 1 {
		return jaegerTrace{}, false
	}
	return body.Data[0], true
}

// span is tr's first span named op (none: a span of no name).
func (tr jaegerTrace) span(op string) jaegerSpan {
	for _, s := range tr.Spans {
		if s.OperationName == op {
			return s
		}
	}
	return jaegerSpan{}
}

// tag is the value of s's tag key, as text; "" when it has none.
func (s jaegerSpan) tag(key string) string {
	for _, tag := range s.Tags {
		if tag.Key == key {
			return fmt.Sprint(tag.Value)
		}
	}
	return ""
}

// childOf tells whether s's parent is the span of ID parent.
func (s jaegerSpan) childOf(parent string) bool {
	for _, r := range s.References {
		if r.RefType == "CHILD_OF" && r.SpanID == parent {
			return true
		}
	}
	return false
}
