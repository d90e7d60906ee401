package main

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// A collector that is away costs nothing, and the spans it loses are
// counted: one that takes connections and never answers (the batch
// processor's queue, made small here, fills and drops) and one that is
// not there at all (Jaeger stopped: every export refused). Every webhook
// of a stream is answered 202 and stored, switchyard_tracing_spans_dropped_total
// counts the spans lost, and SIGTERM's exit stays within shutdown_timeout.
func TestTracingCollectorAway(t *testing.T) {
	t.Parallel()
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	var held sync.WaitGroup
	defer held.Wait()
	go func() {
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			held.Go(func() { // read what comes, answer nothing, until the test ends
				buf := make([]byte, 32<<10)
				for {
					if _, err := c.Read(buf); err != nil {
						return
					}
				}
			})
			t.Cleanup(func() { c.Close() })
		}
	}()
	for _, c := range []struct {
		name, collector string
		env             []string
		// lost is the fewest spans counted lost per webhook sent.
		lost int
	}{
		{"silent", silent.Addr().String(), []string{"OTEL_BSP_MAX_QUEUE_SIZE=64", "OTEL_BSP_EXPORT_TIMEOUT=2000"}, 0},
		{"absent", freeAddr(t), nil, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			addr := freeAddr(t)
			dbPath := filepath.Join(dir, "switchyard.db")
			config := writeConfigWith(t, dir, addr, fmt.Sprintf("path = %q", dbPath), `shutdown_timeout = "5s"`, amqpURL(newVhost(t)))
			appendFile(t, config, fmt.Sprintf("[tracing]\nendpoint = \"http://%s\"\n", c.collector))
			cmd := exec.Command(builtBinary(t), "serve", "-config", config)
			cmd.Env = append(os.Environ(), c.env...)
			out := started(t, cmd)
			eventually(t, 20*time.Second, "serve answering /healthz", func() bool { return answersOK("http://" + addr + "/healthz") })
			body := loadFixture(t, "issues", "opened")
			const webhooks = 100
			for i := range webhooks {
				if code := postWebhook(t, "http://"+addr, "issues", newGUID(), body); code != http.StatusAccepted {
					t.Fatalf("webhook %d with the collector %s: %d\n%s", i, c.name, code, out)
				}
			}
			db := openDB(t, dbPath)
			eventually(t, 30*time.Second, "every webhook stored", func() bool {
				return queryInt(t, db, "SELECT count(*) FROM github") == webhooks
			})
			eventually(t, 30*time.Second, "the spans lost counted", func() bool {
				lost := scrape(t, "http://"+addr+"/metrics")["switchyard_tracing_spans_dropped_total"]
				return lost > 0 && lost >= float64(c.lost*webhooks)
			})
			stopProcess(t, cmd, out, 5*time.Second+2*time.Second)
		})
	}
}

// debugLog sets the config file at path to log at debug.
func debugLog(t *testing.T, path string) {
	t.Helper()
	editConfig(t, path, `level = "info"`, `level = "debug"`)
}

// jaeger is Jaeger v1.75.0's all-in-one (JAEGER, or .tools/jaeger-1.75.0,
// which make test-tracing builds from tools/jaeger: a long build); without
// it the test skips, except under CI=true, where it is built.
func jaeger(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("JAEGER"); p != "" {
		return p
	}
	p, _ := filepath.Abs(".tools/jaeger-1.75.0")
	if _, err := os.Stat(p); err != nil {
		if os.Getenv("CI") != "true" {
			t.Skip("no Jaeger: make test-tracing builds .tools/jaeger-1.75.0 (several minutes) and runs this test")
		}
		makeTool(t, ".tools/jaeger-1.75.0")
	}
	return p
}

// startJaeger runs Jaeger with its memory store, OTLP/HTTP at the address
// it returns first and its query API at the second.
func startJaeger(t *testing.T) (otlp, query string, out *syncBuffer) {
	t.Helper()
	otlp, query = freeAddr(t), freeAddr(t)
	config := fmt.Sprintf(`service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_query:
    storage:
      traces: mem
    enable_tracing: false
    http:
      endpoint: %q
    grpc:
      endpoint: %q
  jaeger_storage:
    backends:
      mem:
        memory:
          max_traces: 10000
receivers:
  otlp:
    protocols:
      http:
        endpoint: %q
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: mem
`, query, freeAddr(t), otlp)
	path := filepath.Join(t.TempDir(), "jaeger.yaml")
	if err := os.WriteFile(path, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	out = started(t, exec.Command(jaeger(t), "--config", path))
	eventually(t, 60*time.Second, "Jaeger's query API", func() bool { return answersOK("http://" + query + "/api/services") })
	return otlp, query, out
}

// jaegerSpan is a span as Jaeger's query API returns it.
type jaegerSpan struct {
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	ProcessID     string `json:"processID"`
	References    []struct {
		RefType string `json:"refType"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	Tags []struct {
		Key   string `json:"key"`
		Value any    `json:"value"`
	} `json:"tags"`
}

// jaegerTrace is a trace as Jaeger's query API returns it: its spans,
// and the processes (nodes) that sent them.
type jaegerTrace struct {
	TraceID   string       `json:"traceID"`
	Spans     []jaegerSpan `json:"spans"`
	Processes map[string]struct {
		Tags []struct {
			Key   string `json:"key"`
			Value any    `json:"value"`
		} `json:"tags"`
	} `json:"processes"`
}

// tracesOf are the traces Jaeger at query holds whose span has tag
// github.delivery = guid.
func tracesOf(t *testing.T, query, guid string) []jaegerTrace {
	t.Helper()
	q := url.Values{"service": {"switchyard"}, "tags": {fmt.Sprintf(`{"github.delivery":%q}`, guid)}, "lookback": {"1h"}, "limit": {"20"}}
	resp, err := http.Get("http://" + query + "/api/traces?" + q.Encode())
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var body struct {
		Data []jaegerTrace `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil
	}
	return body.Data
}

// wholeTrace is the one trace Jaeger at query holds of delivery guid, once
// it holds a span of each operation in want.
func wholeTrace(t *testing.T, query, guid string, want []string) jaegerTrace {
	t.Helper()
	var found jaegerTrace
	eventually(t, 60*time.Second, "the trace of "+guid+" in Jaeger, whole", func() bool {
		traces := tracesOf(t, query, guid)
		if len(traces) != 1 {
			return false
		}
		found = traces[0]
		ops, _ := found.operations()
		for _, w := range want {
			if !slices.Contains(ops, w) {
				return false
			}
		}
		return true
	})
	return found
}

// operations are the names of tr's spans, and the nodes that made them.
func (tr jaegerTrace) operations() (ops []string, nodes map[string][]string) {
	nodes = map[string][]string{}
	for _, s := range tr.Spans {
		ops = append(ops, s.OperationName)
		for _, tag := range tr.Processes[s.ProcessID].Tags {
			if tag.Key == "service.instance.id" {
				nodes[s.OperationName] = append(nodes[s.OperationName], fmt.Sprint(tag.Value))
			}
		}
	}
	slices.Sort(ops)
	return ops, nodes
}

// One trace per delivery, across nodes: a webhook into one of two nodes
// sharing a PostgreSQL database is one trace in Jaeger, found by its GUID,
// holding the door, the publish, both consumers and their commits (with
// their transactions), on whichever nodes took them.
func TestOneTracePerDelivery(t *testing.T) {
	t.Parallel()
	otlp, query, jout := startJaeger(t)
	dbURL := newPostgresDatabase(t)
	vhost := newVhost(t)
	var addrs []string
	var outs []*syncBuffer
	for i := range 2 {
		dir := t.TempDir()
		addr := freeAddr(t)
		config := writeConfigWith(t, dir, addr, fmt.Sprintf("driver = \"postgres\"\nurl = %q", dbURL),
			fmt.Sprintf("node_name = \"node-%d\"\nlease_ttl = \"3s\"", i+1), amqpURL(vhost))
		appendFile(t, config, fmt.Sprintf("[tracing]\nendpoint = \"http://%s\"\nsample_ratio = 1\n", otlp))
		debugLog(t, config)
		_, out := startProcess(t, config, addr)
		addrs, outs = append(addrs, addr), append(outs, out)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("node 1:\n%s\nnode 2:\n%s\njaeger:\n%s", outs[0], outs[1], jout)
		}
	})
	// The webhook comes with an outside producer's trace context (a proxy
	// that traces, say): the delivery's trace is that one.
	const outside = "4bf92f3577b34da6a3ce929d0e0e4736"
	guid := newGUID()
	req := webhookRequest(t, "http://"+addrs[0], "issues", guid, loadFixture(t, "issues", "opened"))
	req.Header.Set("traceparent", "00-"+outside+"-00f067aa0ba902b7-01")
	if code, body := do(t, req); code != http.StatusAccepted {
		t.Fatalf("webhook: %d %s", code, body)
	}
	want := []string{"POST /webhooks/github", "publish github-exchange", "process github", "process github-database", "commit github", "commit github-database"}
	found := wholeTrace(t, query, guid, want)
	ops, nodes := found.operations()
	t.Logf("trace %s: %s; nodes %v", found.TraceID, strings.Join(ops, ", "), nodes)
	if !slices.Contains(ops, "postgresql transaction") {
		t.Errorf("the trace holds no database transaction: %v", ops)
	}
	if got := nodes["POST /webhooks/github"]; !slices.Equal(got, []string{"node-1"}) {
		t.Errorf("the door's span came from %v, want node-1, which took the webhook", got)
	}
	if found.TraceID != outside {
		t.Errorf("the delivery's trace is %s, want the caller's %s", found.TraceID, outside)
	}
	// The publish histogram and the webhook's carry the trace as an
	// exemplar, in the OpenMetrics exposition.
	mreq, _ := http.NewRequest(http.MethodGet, "http://"+addrs[0]+"/metrics", nil)
	mreq.Header.Set("Accept", "application/openmetrics-text; version=1.0.0")
	_, metrics := do(t, mreq)
	for _, histogram := range []string{"switchyard_publish_duration_seconds_bucket{", `switchyard_webhook_duration_seconds_bucket{outcome="accepted"`} {
		if !slices.ContainsFunc(strings.Split(metrics, "\n"), func(l string) bool {
			return strings.HasPrefix(l, histogram) && strings.Contains(l, `# {trace_id="`+outside+`"}`)
		}) {
			t.Errorf("no exemplar of trace %s on %s in the OpenMetrics exposition", outside, histogram)
		}
	}
	// A log line about the delivery names its trace and its span: the
	// door's, at debug.
	logged := strings.Contains(outs[0].String(), "msg=\"webhook queued\" trace_id="+found.TraceID+" span_id=")
	if !logged {
		t.Errorf("no log line carries trace_id=%s and a span_id", found.TraceID)
	}
	// Through the retry cycle: the database refuses the delivery's raw
	// row a few times (a trigger of the test's: a sequence counts, past a
	// rollback), and each attempt is a span of its trace.
	retried := newGUID()
	db := openWritableDB(t, DatabaseConfig{Driver: "postgres", URL: dbURL})
	for _, q := range []string{"CREATE SEQUENCE refusals",
		`CREATE FUNCTION refuse_twice() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
			IF NEW.delivery_id = '` + retried + `' AND nextval('refusals') <= 4 THEN RAISE EXCEPTION 'refused by the test'; END IF;
			RETURN NEW; END $$`,
		"CREATE TRIGGER refuse_twice BEFORE INSERT ON github FOR EACH ROW EXECUTE FUNCTION refuse_twice()"} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	if code := postWebhook(t, "http://"+addrs[1], "issues", retried, loadFixture(t, "issues", "opened")); code != http.StatusAccepted {
		t.Fatalf("webhook: %d", code)
	}
	eventually(t, 60*time.Second, "each attempt of the retry cycle in the trace", func() bool {
		traces := tracesOf(t, query, retried)
		if len(traces) != 1 {
			return false
		}
		attempts := map[string]bool{}
		for _, s := range traces[0].Spans {
			for _, tag := range s.Tags {
				if s.OperationName == "process github" && tag.Key == "switchyard.attempt" {
					attempts[fmt.Sprint(tag.Value)] = true
				}
			}
		}
		return len(attempts) >= 3 // refused at least twice (once or twice an attempt), then stored
	})

	// The delivery's story names its trace.
	req = httpRequest(t, http.MethodGet, "http://"+addrs[1]+"/api/v1/deliveries/"+guid, "", "operator-token-for-tests")
	if code, story := do(t, req); code != http.StatusOK || !strings.Contains(story, `"trace_id":"`+found.TraceID+`"`) {
		t.Errorf("the story: %d %s, want trace_id %s", code, story, found.TraceID)
	}
}
