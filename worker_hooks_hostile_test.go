package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A broken or hostile GitHub API costs a bounded amount: these tests stand
// one up and hold the hooks worker to its bounds, with the real RabbitMQ
// and SQLite behind it.

// rssBytes is this process's resident set, from /proc.
func rssBytes(t testing.TB) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	t.Fatal("no VmRSS in /proc/self/status")
	return 0
}

// rssGrowth runs fn and returns how far the process's resident set rose
// above where it stood before, sampled every 5 ms while fn ran.
func rssGrowth(t testing.TB, fn func()) int64 {
	t.Helper()
	before := rssBytes(t)
	var peak atomic.Int64
	peak.Store(before)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			if r := rssBytes(t); r > peak.Load() {
				peak.Store(r)
			}
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	})
	fn()
	close(done)
	wg.Wait()
	return peak.Load() - before
}

// hostileAPI serves GET /app/hook/deliveries with page(n, cursor), n
// counting the requests from 1.
type hostileAPI struct {
	srv   *httptest.Server
	pages atomic.Int64
}

func newHostileAPI(t testing.TB, page func(w http.ResponseWriter, n int64, cursor string)) *hostileAPI {
	h := &hostileAPI{}
	h.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/app/hook/deliveries" {
			http.NotFound(w, r)
			return
		}
		page(w, h.pages.Add(1), r.URL.Query().Get("cursor"))
	}))
	t.Cleanup(h.srv.Close)
	return h
}

// deliveryPage writes a page of 100 deliveries, in flight (a 2xx minutes
// ago, not stored), so that a poll publishes nothing, and a Link to next.
func deliveryPage(w http.ResponseWriter, srvURL string, n int64, next string) {
	var page []hookDelivery
	for i := range 100 {
		page = append(page, hookDelivery{ID: n*1000 + int64(i), GUID: fmt.Sprintf("hostile-%d-%d", n, i),
			DeliveredAt: time.Now().UTC().Add(-time.Minute), Status: "OK", StatusCode: 200, Event: "issues"})
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Link", fmt.Sprintf(`<%s/app/hook/deliveries?per_page=100&cursor=%s>; rel="next"`, srvURL, next))
	_ = json.NewEncoder(w).Encode(page)
}

// A cursor that comes back again ends the poll at once; cursors that never
// end stop at github.max_pages_per_poll. Neither moves the checkpoint past
// what was not seen, and memory stays bounded.
func TestLedgerHostileCursors(t *testing.T) {
	gh := newFakeGitHub(t)
	var api *hostileAPI
	api = newHostileAPI(t, func(w http.ResponseWriter, n int64, _ string) { deliveryPage(w, api.srv.URL, n, "v1_loop") })
	hooks, _, store, logs := hooksForTestAt(t, gh, api.srv.URL)
	ctx := context.Background()
	if _, err := hooks.Poll(ctx, Holding{}); err != nil {
		t.Fatal(err)
	}
	if n := api.pages.Load(); n != 2 {
		t.Errorf("pages read with a cursor that loops: %d, want 2 (the second brought it back)", n)
	}
	if !strings.Contains(logs.String(), "a cursor came back again") {
		t.Errorf("the looping cursor is not logged")
	}
	cp, _ := store.Setting(ctx, keyHooksCheckpoint)
	if t0, err := time.Parse(time.RFC3339Nano, cp); err != nil || time.Since(t0) < githubRedeliveryWindow-time.Hour {
		t.Errorf("checkpoint %q after a listing that stopped short, want it still 72h back", cp)
	}

	var endless *hostileAPI
	endless = newHostileAPI(t, func(w http.ResponseWriter, n int64, _ string) {
		deliveryPage(w, endless.srv.URL, n, fmt.Sprintf("v1_%d", n))
	})
	hooks, _, _, logs = hooksForTestAt(t, gh, endless.srv.URL)
	growth := rssGrowth(t, func() {
		if _, err := hooks.Poll(ctx, Holding{}); err != nil {
			t.Error(err)
		}
	})
	if n := endless.pages.Load(); n != int64(DefaultConfig().GitHub.MaxPagesPerPoll) {
		t.Errorf("pages read from an endless listing: %d, want github.max_pages_per_poll, %d", n, DefaultConfig().GitHub.MaxPagesPerPoll)
	}
	if !strings.Contains(logs.String(), "stopped after github.max_pages_per_poll pages") {
		t.Errorf("the stop at the page limit is not logged")
	}
	if growth > 50<<20 {
		t.Errorf("RSS grew %d MiB over an endless listing, want under 50", growth>>20)
	}
}

// One page of 100,000 deliveries, 73 MB: refused once it passes what a page
// of 100 can weigh, whether it said its length or streamed it, without
// holding it.
func TestLedgerHugePage(t *testing.T) {
	gh := newFakeGitHub(t)
	for _, declared := range []bool{false, true} {
		t.Run(map[bool]string{false: "streamed", true: "with Content-Length"}[declared], func(t *testing.T) {
			item := func(i int) []byte {
				b, _ := json.Marshal(hookDelivery{ID: int64(i), GUID: fmt.Sprintf("%036d", i), DeliveredAt: time.Now().UTC(),
					Status: "Invalid HTTP Response: 503", StatusCode: 503, Event: "pull_request_review_comment"})
				return b
			}
			const count = 100000
			size := 2 + count*(len(item(0))+1)
			api := newHostileAPI(t, func(w http.ResponseWriter, _ int64, _ string) {
				w.Header().Set("Content-Type", "application/json")
				if declared {
					w.Header().Set("Content-Length", strconv.Itoa(size))
				}
				bw := bufio.NewWriter(w)
				bw.WriteString("[")
				for i := range count {
					if i > 0 {
						bw.WriteString(",")
					}
					bw.Write(item(i))
				}
				bw.WriteString("]")
				bw.Flush()
			})
			hooks, _, _, _ := hooksForTestAt(t, gh, api.srv.URL)
			var err error
			growth := rssGrowth(t, func() { _, err = hooks.Poll(context.Background(), Holding{}) })
			if !errors.Is(err, ErrAPIResponseTooLarge) {
				t.Errorf("a 73 MB page: %v, want ErrAPIResponseTooLarge", err)
			}
			if growth > 50<<20 {
				t.Errorf("RSS grew %d MiB over a 73 MB page, want under 50", growth>>20)
			}
			if n := api.pages.Load(); n != 1 {
				t.Errorf("pages asked for: %d, want the one", n)
			}
		})
	}
}

// A poll whose API never answers ends at its deadline, while the API still
// stalls, with an error.
func TestLedgerPollDeadline(t *testing.T) {
	t.Parallel()
	gh := newFakeGitHub(t)
	stall := make(chan struct{})
	defer close(stall)
	api := newHostileAPI(t, func(w http.ResponseWriter, _ int64, _ string) { <-stall })
	hooks, _, _, _ := hooksForTestAt(t, gh, api.srv.URL)
	hooks.pollTimeout = 500 * time.Millisecond
	if _, err := hooks.Poll(context.Background(), Holding{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a poll of an API that stalls: %v, want its deadline", err)
	}
	select {
	case <-stall:
		t.Fatal("the stall ended before the poll")
	default:
	}
}

// 300 gaps found in one poll: GitHub is asked for at most
// github.redeliver_per_minute of them that minute, and no more at a poll
// within the same minute.
func TestGapRedeliveriesPaced(t *testing.T) {
	t.Parallel()
	gh := newFakeGitHub(t)
	for i := range 300 {
		gh.add(hookDelivery{ID: int64(5000 + i), GUID: newGUID(), DeliveredAt: time.Now().UTC().Add(-5 * time.Hour),
			Status: "Accepted", StatusCode: 202, Event: "issues"}, nil)
	}
	hooks, _, store, _ := hooksForTest(t, gh)
	ctx := context.Background()
	for range 2 {
		if _, err := hooks.Poll(ctx, Holding{}); err != nil {
			t.Fatal(err)
		}
	}
	perMinute := DefaultConfig().GitHub.RedeliverPerMinute
	if got := len(gh.redelivered()); got != perMinute {
		t.Errorf("redeliveries asked in two polls within a minute: %d, want github.redeliver_per_minute, %d", got, perMinute)
	}
	if _, total, _ := store.OpenGaps(ctx, 1); total != 300 {
		t.Errorf("open gaps: %d, want 300", total)
	}
}

// A redelivery GitHub refuses with 404 three times makes the gap
// unrecoverable: alerted once, shown so, never asked for again.
func TestGapUnrecoverable(t *testing.T) {
	t.Parallel()
	gh := newFakeGitHub(t)
	guid := newGUID()
	gh.add(hookDelivery{ID: 61, GUID: guid, DeliveredAt: time.Now().UTC().Add(-5 * time.Hour), Status: "Accepted", StatusCode: 202, Event: "issues"}, nil)
	gh.failNext = []int{http.StatusNotFound, http.StatusGone, http.StatusUnprocessableEntity}
	hooks, _, store, logs := hooksForTest(t, gh)
	ctx := context.Background()
	for range 5 {
		if _, err := hooks.Poll(ctx, Holding{}); err != nil {
			t.Fatal(err)
		}
	}
	if got := gh.redelivered(); len(got) != 0 {
		t.Errorf("redeliveries taken: %v, want none: the gap was given up after three refusals", got)
	}
	gaps, _, err := store.OpenGaps(ctx, 10)
	if err != nil || len(gaps) != 1 || gaps[0].UnrecoverableAt == nil || gaps[0].Refusals != 3 {
		t.Fatalf("gaps: %+v (%v), want one unrecoverable after 3 refusals", gaps, err)
	}
	if n := queryInt(t, store.r, "SELECT count(*) FROM alert_outbox WHERE delivery_id = $1", unrecoverableAlertID(guid)); n != 1 {
		t.Errorf("unrecoverable alerts queued: %d, want 1", n)
	}
	if !strings.Contains(logs.String(), "delivery gap, unrecoverable") {
		t.Errorf("the gap given up on is not logged")
	}
}

// A failed delivery listed with a 300-byte GUID, or an event no webhook may
// name, is an unrecoverable gap: nothing is published, and the shared AMQP
// connection stays up.
func TestLedgerHostileGUID(t *testing.T) {
	t.Parallel()
	gh := newFakeGitHub(t)
	long := strings.Repeat("g", 300)
	gh.add(hookDelivery{ID: 71, GUID: long, DeliveredAt: time.Now().UTC().Add(-time.Hour), Status: "Invalid HTTP Response: 503", StatusCode: 503, Event: "issues"}, nil)
	gh.add(hookDelivery{ID: 72, GUID: newGUID(), DeliveredAt: time.Now().UTC().Add(-time.Hour), Status: "Invalid HTTP Response: 503", StatusCode: 503, Event: "Bad Event!"}, nil)
	good := newGUID()
	gh.add(hookDelivery{ID: 73, GUID: good, DeliveredAt: time.Now().UTC().Add(-time.Hour), Status: "Invalid HTTP Response: 503", StatusCode: 503, Event: "issues"}, nil)
	hooks, vhost, store, _ := hooksForTest(t, gh)
	ctx := context.Background()
	// The connection is up before the poll: one to compare with after.
	if err := hooks.queues.Publish(ctx, mustBroker(t, hooks.brokers), "", queueForbidden, eventMessage("ping", newGUID(), []byte(`{}`))); err != nil {
		t.Fatal(err)
	}
	before := brokerConnections(t, vhost)
	n, err := hooks.Poll(ctx, Holding{})
	if err != nil || n != 1 {
		t.Fatalf("poll: queued %d, %v; want the one good delivery queued", n, err)
	}
	if after := brokerConnections(t, vhost); len(before) != 1 || strings.Join(after, ",") != strings.Join(before, ",") {
		t.Errorf("AMQP connections before %v, after %v: want the same one", before, after)
	}
	if got := ready(t, vhost, queueHooks); got != 1 {
		t.Errorf("github-hooks holds %d, want the good delivery only", got)
	}
	if u, _ := store.UnrecoverableGapCount(ctx); u != 2 {
		t.Errorf("unrecoverable gaps: %d, want the 300-byte GUID and the bad event", u)
	}
}

// mustBroker is the first configured broker.
func mustBroker(t testing.TB, b *Brokers) *Broker {
	t.Helper()
	br, err := b.Get(0)
	if err != nil {
		t.Fatal(err)
	}
	return br
}

// The delivery page's "Ask GitHub to redeliver": GitHub is asked once for a
// gap, a second press sends nothing, and a form without its token is
// refused.
func TestRedeliverFromDeliveryPage(t *testing.T) {
	t.Parallel()
	gh := newFakeGitHub(t)
	guid := newGUID()
	gh.add(hookDelivery{ID: 81, GUID: guid, DeliveredAt: time.Now().UTC().Add(-5 * time.Hour), Status: "Accepted", StatusCode: 202, Event: "issues"}, nil)
	cfg, _ := hooksConfig(t, gh)
	cfg.GitHub.RedeliverGaps = false // only the operator asks
	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "the poll records the gap", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM delivery_gaps WHERE guid = $1", guid) == 1
	})
	req, _ := http.NewRequest(http.MethodGet, d.URL+"/status/deliveries/"+guid, nil)
	req.SetBasicAuth("operator", "operator-token-for-tests")
	code, page := do(t, req)
	_, rest, _ := strings.Cut(page, `id="redeliver">`)
	_, rest, _ = strings.Cut(rest, `name="token" value="`)
	token, _, _ := strings.Cut(rest, `"`)
	if code != http.StatusOK || token == "" {
		t.Fatalf("the gap's page: %d, token %q; want 200 with the redeliver form", code, token)
	}
	if !strings.Contains(page, "github attempt") || !strings.Contains(page, " 202 Accepted") {
		t.Errorf("the gap's page does not show GitHub's attempt and its answer:\n%s", page)
	}
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	press := func(token string) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, d.URL+"/status/deliveries/"+guid+"/redeliver", strings.NewReader("token="+token))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("Origin", d.URL)
		req.SetBasicAuth("operator", "operator-token-for-tests")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode, resp.Header.Get("Location")
	}
	if code, _ := press("forged"); code != http.StatusForbidden || len(gh.redelivered()) != 0 {
		t.Errorf("a forged form: %d, redeliveries %v; want 403 and none", code, gh.redelivered())
	}
	if code, to := press(token); code != http.StatusSeeOther || !strings.Contains(to, "redelivered=asked") {
		t.Errorf("press: %d to %q, want 303 saying GitHub was asked", code, to)
	}
	if code, to := press(token); code != http.StatusSeeOther || !strings.Contains(to, "redelivered=already") {
		t.Errorf("second press: %d to %q, want 303 saying nothing was sent", code, to)
	}
	if got := gh.redelivered(); len(got) != 1 || got[0] != 81 {
		t.Errorf("redeliveries GitHub got: %v, want 81 once", got)
	}
}
