package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// fakeHook is a repository's or an organization's webhook as GitHub's API
// keeps it: its deliveries under prefix (/repos/OWNER/NAME/hooks/ID or
// /orgs/ORG/hooks/ID), read only with token.
type fakeHook struct {
	prefix string
	id     int64
	token  string
	// targetType and targetID are what GitHub sent the hook's webhooks
	// with (X-GitHub-Hook-Installation-Target-*).
	targetType, targetID string
	// refuse, when set, answers every request with it (401, 403, 404).
	refuse int

	deliveries   []hookDelivery // newest first
	payloads     map[int64][]byte
	fetches      map[int64]int
	lists        int
	redeliveries []int64
	// wrongTokens counts requests that came with another credential.
	wrongTokens int
}

// hook serves a webhook's deliveries at prefix, read with token.
func (g *fakeGitHub) hook(prefix string, id int64, token, targetType, targetID string) *fakeHook {
	g.mu.Lock()
	defer g.mu.Unlock()
	h := &fakeHook{prefix: prefix, id: id, token: token, targetType: targetType, targetID: targetID,
		payloads: map[int64][]byte{}, fetches: map[int64]int{}}
	if g.hooks == nil {
		g.hooks = map[string]*fakeHook{}
	}
	g.hooks[prefix] = h
	return h
}

// addTo records one attempt of h's; payload is the original request's body.
func (g *fakeGitHub) addTo(h *fakeHook, d hookDelivery, payload []byte) {
	g.mu.Lock()
	defer g.mu.Unlock()
	h.deliveries = append([]hookDelivery{d}, h.deliveries...)
	if payload != nil {
		h.payloads[d.ID] = payload
	}
}

// read runs fn under the fake's lock, for a test to look at a hook.
func (g *fakeGitHub) read(fn func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	fn()
}

// serveHook answers the requests under one of g.hooks, or reports that
// the path is none of theirs. Called with g.mu held.
func (g *fakeGitHub) serveHook(w http.ResponseWriter, r *http.Request) bool {
	var h *fakeHook
	var rest string
	for prefix, fh := range g.hooks {
		if after, ok := strings.CutPrefix(r.URL.Path, prefix+"/"); ok {
			h, rest = fh, after
		}
	}
	if h == nil {
		return false
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	if r.Header.Get("Authorization") != "Bearer "+h.token {
		h.wrongTokens++
		w.WriteHeader(http.StatusUnauthorized)
		fmt.Fprint(w, `{"message":"Bad credentials"}`)
		return true
	}
	if h.refuse != 0 {
		w.WriteHeader(h.refuse)
		fmt.Fprint(w, `{"message":"Resource not accessible by personal access token"}`)
		return true
	}
	switch {
	case rest == "deliveries":
		h.lists++
		_ = json.NewEncoder(w).Encode(h.deliveries) // one page: a handful
		return true
	case strings.HasSuffix(rest, "/attempts") && r.Method == http.MethodPost:
		id, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimPrefix(rest, "deliveries/"), "/attempts"), 10, 64)
		h.redeliveries = append(h.redeliveries, id)
		w.WriteHeader(http.StatusAccepted)
		fmt.Fprint(w, `{}`)
		return true
	}
	id, _ := strconv.ParseInt(strings.TrimPrefix(rest, "deliveries/"), 10, 64)
	for _, d := range h.deliveries {
		if d.ID != id {
			continue
		}
		h.fetches[id]++
		_ = json.NewEncoder(w).Encode(map[string]any{
			"id": d.ID, "guid": d.GUID, "delivered_at": d.DeliveredAt, "redelivery": d.Redelivery, "duration": 0.3,
			"status": d.Status, "status_code": d.StatusCode, "event": d.Event, "action": d.Action,
			"request": map[string]any{
				"headers": map[string]string{
					"Content-Type": "application/json", "User-Agent": "GitHub-Hookshot/5c6ad3b",
					"X-GitHub-Delivery": d.GUID, "X-GitHub-Event": d.Event, "X-GitHub-Hook-ID": strconv.FormatInt(h.id, 10),
					"X-GitHub-Hook-Installation-Target-ID": h.targetID, "X-GitHub-Hook-Installation-Target-Type": h.targetType,
				},
				"payload": json.RawMessage(h.payloads[id]),
			},
			"response": map[string]any{"headers": map[string]string{}, "payload": "bad gateway"},
		})
		return true
	}
	w.WriteHeader(http.StatusNotFound)
	fmt.Fprint(w, `{"message":"Not Found"}`)
	return true
}

// serveInstallation answers the App's installation on acme/gadgets and
// its access token (ghs_installation_token), with the App's JWT; it
// reports whether the path was one of theirs. Called with g.mu held.
func (g *fakeGitHub) serveInstallation(w http.ResponseWriter, r *http.Request) bool {
	switch {
	case r.URL.Path == "/repos/acme/gadgets/installation" && r.Method == http.MethodGet:
		g.installationAsks++
		_ = json.NewEncoder(w).Encode(map[string]any{"id": 99, "app_id": testAppID})
	case r.URL.Path == "/app/installations/99/access_tokens" && r.Method == http.MethodPost:
		g.installationTokens++
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]any{"token": "ghs_installation_token", "expires_at": time.Now().Add(time.Hour)})
	default:
		return false
	}
	return true
}

// Every hook mended: beside the App's own hook, a repository's webhook
// and an organization's, each with its token, one on the App's
// installation token, and one whose token GitHub refuses. A delivery that
// failed on two hooks is replayed once under each, with that hook's ID; a
// delivery whose App copy is stored but whose repository copy failed is
// replayed for the repository; a stored one is left alone; a 2xx delivery
// not stored is a gap of its hook, asked again through that hook's
// endpoint; every call carries its own hook's credential. The refused
// hook is a problem in status, named, and alerted once, while the others
// go on. Without the per-hook ledger none of it is read.
func TestEveryHookMended(t *testing.T) {
	t.Parallel()
	onBothStores(t, testEveryHookMended)
}

func testEveryHookMended(t *testing.T) {
	gh := newFakeGitHub(t)
	repo := gh.hook("/repos/acme/widgets/hooks/111", 111, "github_pat_widgets", "repository", "456")
	org := gh.hook("/orgs/acme/hooks/222", 222, "github_pat_acme", "organization", "789")
	inst := gh.hook("/repos/acme/gadgets/hooks/444", 444, "ghs_installation_token", "repository", "457")
	locked := gh.hook("/repos/acme/locked/hooks/333", 333, "github_pat_locked", "repository", "458")
	locked.refuse = http.StatusForbidden
	cfg, _ := hooksConfig(t, gh)
	cfg.GitHub.BotAppID = testAppID
	cfg.GitHub.ReconcileGrace = time.Minute
	cfg.GitHub.Hooks = []HookConfig{
		{ID: 111, Repository: "acme/widgets", Token: "github_pat_widgets"},
		{ID: 222, Organization: "acme", Token: "github_pat_acme"},
		{ID: 444, Repository: "acme/gadgets"}, // the App's installation token
		{ID: 333, Repository: "acme/locked", Token: "github_pat_locked"},
	}
	cfg.Alerts = AlertsConfig{Rules: []AlertRule{{Events: []string{"ledger", "gap"}, Channels: []string{"push"}}},
		Push: PushConfig{URL: "http://127.0.0.1:1/never"}}

	issues := loadFixture(t, "issues", "opened")
	then := time.Now().UTC().Add(-10 * time.Minute)
	failed := func(id int64, guid string) hookDelivery {
		return hookDelivery{ID: id, GUID: guid, DeliveredAt: then, Status: "Bad Gateway", StatusCode: 502, Event: "issues", Action: ptr("opened")}
	}
	shared, cross, stored, gap, viaApp, app, lockedGUID := newGUID(), newGUID(), newGUID(), newGUID(), newGUID(), newGUID(), newGUID()
	gh.addTo(repo, failed(1001, shared), issues)
	gh.addTo(org, failed(2001, shared), issues)
	gh.addTo(repo, failed(1003, cross), issues)
	gh.addTo(org, failed(2002, stored), issues)
	gh.addTo(repo, hookDelivery{ID: 1002, GUID: gap, DeliveredAt: then, Status: "OK", StatusCode: 202, Event: "issues"}, nil)
	gh.addTo(inst, failed(4001, viaApp), issues)
	gh.addTo(locked, failed(3001, lockedGUID), issues)
	gh.add(hookDelivery{ID: 1, GUID: app, DeliveredAt: then, Status: "Service Unavailable", StatusCode: 503, Event: "issues"}, issues)

	// The App's copy of cross is stored: its repository copy is not. The
	// organization's copy of stored is.
	storedBefore(t, cfg,
		&Event{DeliveryID: cross, HookID: 42, TargetType: "integration", TargetID: testAppID, Name: "issues", Payload: issues, ReceivedAt: time.Now()},
		&Event{DeliveryID: stored, HookID: 222, TargetType: "organization", TargetID: 789, Name: "issues", Payload: issues, ReceivedAt: time.Now()})

	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)
	copies := func(guid string, hook int64) int {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1 AND hook_id = $2", guid, hook)
	}
	eventually(t, time.Minute, "each failed delivery stored under its own hook", func() bool {
		return copies(shared, 111) == 1 && copies(shared, 222) == 1 && copies(cross, 111) == 1 && copies(viaApp, 444) == 1 &&
			queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1 AND target_type = 'integration'", app) == 1
	})
	eventually(t, 30*time.Second, "the repository hook's gap recorded and asked again through its endpoint", func() bool {
		var asked []int64
		gh.read(func() { asked = append(asked, repo.redeliveries...) })
		return queryInt(t, db, "SELECT count(*) FROM delivery_gaps WHERE hook_id = 111 AND guid = $1", gap) == 1 && len(asked) == 1 && asked[0] == 1002
	})
	var st Status
	eventually(t, 30*time.Second, "the refused hook a problem in status", func() bool {
		code, raw := do(t, mustRequestAuth(t, d.URL+"/api/v1/status"))
		st = Status{}
		if err := json.Unmarshal([]byte(raw), &st); code != http.StatusOK || err != nil {
			t.Fatalf("GET /api/v1/status: %d %v %s", code, err, raw)
		}
		for _, p := range st.Problems {
			if strings.Contains(p, "repository acme/locked hook 333") && strings.Contains(p, "403") {
				return true
			}
		}
		return false
	})
	if len(st.Ledgers) != 5 {
		t.Errorf("status lists %d ledgers, want the App's and four hooks': %+v", len(st.Ledgers), st.Ledgers)
	}
	for _, l := range st.Ledgers {
		if l.Refused != "" && l.Hook != 333 {
			t.Errorf("ledger %s refused: %s", l.Name, l.Refused)
		}
	}
	if m := scrape(t, d.URL+"/metrics"); m[`switchyard_ledger_refused{hook="333"}`] != 1 || m[`switchyard_ledger_open_gaps{hook="111"}`] != 1 {
		t.Errorf("metrics: ledger_refused{333} %v, ledger_open_gaps{111} %v; want 1 and 1",
			m[`switchyard_ledger_refused{hook="333"}`], m[`switchyard_ledger_open_gaps{hook="111"}`])
	}
	polled := func() (n int) {
		gh.read(func() { n = repo.lists })
		return n
	}
	from := polled()
	eventually(t, 30*time.Second, "two more polls", func() bool { return polled() >= from+2 })
	d.stop(t)

	gh.read(func() {
		for _, c := range []struct {
			h    *fakeHook
			id   int64
			want int
		}{{repo, 1001, 1}, {org, 2001, 1}, {repo, 1003, 1}, {inst, 4001, 1}, {org, 2002, 0}, {repo, 1002, 0}, {locked, 3001, 0}} {
			if got := c.h.fetches[c.id]; got != c.want {
				t.Errorf("%s delivery %d fetched %d times, want %d", c.h.prefix, c.id, got, c.want)
			}
		}
		for _, h := range []*fakeHook{repo, org, inst, locked} {
			if h.wrongTokens != 0 {
				t.Errorf("%s: %d requests with another hook's credential", h.prefix, h.wrongTokens)
			}
		}
		if gh.installationTokens != 1 {
			t.Errorf("the App's installation token made %d times, want once (kept until it ends)", gh.installationTokens)
		}
	})
	for _, c := range []struct {
		hook int64
		guid string
	}{{111, shared}, {222, shared}, {111, cross}, {444, viaApp}, {0, app}} {
		if n := queryInt(t, db, "SELECT count(*) FROM hook_redeliveries WHERE hook_id = $1 AND guid = $2 AND republished_at IS NOT NULL", c.hook, c.guid); n != 1 {
			t.Errorf("hook_redeliveries: hook %d's %s recorded republished %d times, want once", c.hook, c.guid, n)
		}
	}
	if n := queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", stored); n != 1 {
		t.Errorf("the stored delivery has %d copies, want the one stored before", n)
	}
	if n := queryInt(t, db, "SELECT count(*) FROM alert_outbox WHERE delivery_id LIKE 'ledger:repository acme/locked hook 333 since %'"); n != 1 {
		t.Errorf("%d alerts of the refused ledger, want one", n)
	}

	// switchyard deliveries -hook 111: that hook's ledger alone; -gaps: the
	// gap with its hook.
	var out bytes.Buffer
	if err := listDeliveries(context.Background(), cfg, slog.New(slog.DiscardHandler), DeliveriesOptions{Since: time.Hour, Hook: 111}, &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`repository acme/widgets hook 111`, `stored +` + shared, `stored +` + cross, `gap +` + gap, gap + ` +111 `} {
		if !regexp.MustCompile(want).MatchString(out.String()) {
			t.Errorf("deliveries -hook 111 lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "organization acme hook 222") {
		t.Errorf("deliveries -hook 111 lists another hook's ledger:\n%s", out.String())
	}
}

// A repository's or an organization's webhook's ledger, with no App, is
// the hooks job's too: run under its lease, on one node of a fleet, not
// on every node at once.
func TestLedgerWithoutAppUnderTheHooksLease(t *testing.T) {
	t.Parallel()
	cfg := testConfig(t, amqpURL("/"))
	cfg.GitHub.AppID = 0
	if slices.Contains(leaseJobs(cfg), jobHooks) {
		t.Errorf("no App and no ledger hook: jobs %v hold the hooks job", leaseJobs(cfg))
	}
	for _, h := range []HookConfig{{ID: 1, Repository: "octo/hello", Token: "t"}, {ID: 2, Organization: "octo", Token: "t"}} {
		cfg.GitHub.Hooks = []HookConfig{h}
		if !slices.Contains(leaseJobs(cfg), jobHooks) {
			t.Errorf("ledger hook %+v with no App: jobs %v leave the hooks job out", h, leaseJobs(cfg))
		}
	}
}
