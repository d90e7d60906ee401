package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

const testBotAppID = 4242

// postAs sends a signed delivery as GitHub sends it to the bot App's hook
// (bot = true) or to a repository hook.
func postAs(t testing.TB, url, event, guid string, body []byte, bot bool) {
	t.Helper()
	r := webhookRequest(t, url, event, guid, body)
	if bot {
		r.Header.Set("X-GitHub-Hook-Installation-Target-Type", "integration")
		r.Header.Set("X-GitHub-Hook-Installation-Target-ID", fmt.Sprint(testBotAppID))
	}
	if code, b := do(t, r); code != http.StatusAccepted {
		t.Fatalf("%s %s: got %d %s, want 202", event, guid, code, b)
	}
}

// mutate changes a real payload: fn edits it as a generic JSON object.
func mutate(t testing.TB, body []byte, fn func(p map[string]any)) []byte {
	t.Helper()
	var p map[string]any
	if err := json.Unmarshal(body, &p); err != nil {
		t.Fatal(err)
	}
	fn(p)
	b, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func obj(p map[string]any, key string) map[string]any { return p[key].(map[string]any) }

// waitDatabase waits until database-service finished every delivery.
func waitDatabase(t testing.TB, db *sql.DB, guids ...string) {
	t.Helper()
	eventually(t, 30*time.Second, fmt.Sprintf("database-service finished %d deliveries", len(guids)), func() bool {
		for _, g := range guids {
			if queryInt(t, db, "SELECT count(*) FROM worker_deliveries WHERE worker = 'database-service' AND delivery_id = $1", g) == 0 {
				return false
			}
		}
		return true
	})
}

func botDaemon(t *testing.T) (*testDaemon, *Config, *sql.DB) {
	t.Helper()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.GitHub.BotAppID = testBotAppID
	d := startDaemon(t, cfg)
	return d, cfg, openStoreDB(t, cfg.Database)
}

var botTables = []string{"github_branches", "github_issues", "github_pull_requests", "github_comments",
	"github_discussions", "github_check_runs", "github_pushes", "github_installations", "github_repositories"}

// Every fixture of the bot's Events, delivered to the bot's hook, produces its
// row with the key columns right; delivered to a repository hook it touches
// no bot table, while release tracking still runs.
func TestDatabaseServiceFixtures(t *testing.T) {
	t.Parallel()
	onBothStores(t, testDatabaseServiceFixtures)
}

func testDatabaseServiceFixtures(t *testing.T) {
	events := map[string]string{ // event -> the table its rows go to
		"create": "github_branches", "delete": "github_branches", "issues": "github_issues",
		"pull_request": "github_pull_requests", "issue_comment": "github_comments",
		"pull_request_review_comment": "github_comments", "commit_comment": "github_comments",
		"discussion": "github_discussions", "discussion_comment": "github_discussions",
		"check_run": "github_check_runs", "push": "github_pushes", "installation": "github_installations",
		"installation_repositories": "github_installations", "repository": "github_repositories",
		"release": "github_releases", "workflow_run": "github_release_workflow_runs",
	}
	var fixtures []fixture
	for _, f := range loadFixtures(t) {
		if _, ok := events[f.Event]; ok {
			fixtures = append(fixtures, f)
		}
	}

	for _, bot := range []bool{true, false} {
		t.Run(map[bool]string{true: "bot", false: "not bot"}[bot], func(t *testing.T) {
			d, _, db := botDaemon(t)
			var guids []string
			for _, f := range fixtures {
				g := newGUID()
				guids = append(guids, g)
				postAs(t, d.URL, f.Event, g, f.Body, bot)
			}
			waitDatabase(t, db, guids...)
			if n := ready(t, d.brokers.List()[0].Vhost, errorQueue(queueDatabase)); n != 0 {
				t.Fatalf("github-database-error holds %d messages; every fixture should be taken", n)
			}
			for i, f := range fixtures {
				checkFixtureRow(t, db, f, guids[i], bot)
			}
			if !bot {
				for _, table := range botTables {
					if n := queryInt(t, db, "SELECT count(*) FROM "+table); n != 0 {
						t.Errorf("%s: %d rows from non-bot Events, want 0", table, n)
					}
				}
			}
		})
	}
}

// checkFixtureRow asserts the row one fixture must have produced.
func checkFixtureRow(t *testing.T, db *sql.DB, f fixture, guid string, bot bool) {
	t.Helper()
	var p struct {
		Action     string `json:"action"`
		Ref        string `json:"ref"`
		After      string `json:"after"`
		Repository struct {
			FullName string `json:"full_name"`
		} `json:"repository"`
		Release     struct{ ID int64 }
		WorkflowRun struct{ ID int64 } `json:"workflow_run"`
		Issue       struct {
			NodeID string `json:"node_id"`
			Number int64
		}
		PullRequest struct {
			NodeID string `json:"node_id"`
			Number int64
		} `json:"pull_request"`
		Comment    struct{ ID int64 }
		Discussion struct {
			NodeID string `json:"node_id"`
			Number int64
		}
		CheckRun     struct{ ID int64 } `json:"check_run"`
		Installation struct{ ID int64 }
	}
	if err := json.Unmarshal(f.Body, &p); err != nil {
		t.Fatal(err)
	}
	name := f.Event + "/" + f.Name
	count := func(query string, args ...any) int { return queryInt(t, db, query, args...) }
	switch f.Event {
	case "release":
		if count("SELECT count(*) FROM github_releases WHERE release_id = $1 AND repository = $2", p.Release.ID, p.Repository.FullName) != 1 {
			t.Errorf("%s: no github_releases row for release %d", name, p.Release.ID)
		}
		return
	case "workflow_run":
		if count("SELECT count(*) FROM github_release_workflow_runs WHERE run_id = $1 AND repository = $2", p.WorkflowRun.ID, p.Repository.FullName) != 1 {
			t.Errorf("%s: no workflow run row for run %d", name, p.WorkflowRun.ID)
		}
		return
	}
	if !bot {
		return
	}
	switch f.Event {
	case "create", "delete":
		if count("SELECT count(*) FROM github_branches WHERE delivery_id = $1 AND ref = $2 AND event = $3 AND repository = $4 AND processing_state = 'NEW' AND target_type = 'integration' AND target_id = $5",
			guid, p.Ref, f.Event, p.Repository.FullName, testBotAppID) != 1 {
			t.Errorf("%s: no github_branches row for delivery %s", name, guid)
		}
	case "issues", "pull_request":
		table, node, number, actions := "github_issues", p.Issue.NodeID, p.Issue.Number, issueActions
		if f.Event == "pull_request" {
			table, node, number, actions = "github_pull_requests", p.PullRequest.NodeID, p.PullRequest.Number, pullActions
		}
		owner, repo, _ := strings.Cut(p.Repository.FullName, "/")
		if count("SELECT count(*) FROM "+table+" WHERE node_id = $1 AND number = $2 AND repository_owner = $3 AND repository_name = $4", node, number, owner, repo) != 1 && containsString(actions, p.Action) {
			t.Errorf("%s: no %s row for %s", name, table, node)
		}
	case "issue_comment", "pull_request_review_comment", "commit_comment":
		if count("SELECT count(*) FROM github_comments WHERE comment_id = $1 AND event = $2 AND repository = $3", p.Comment.ID, f.Event, p.Repository.FullName) != 1 {
			t.Errorf("%s: no github_comments row for comment %d", name, p.Comment.ID)
		}
	case "discussion", "discussion_comment":
		if count("SELECT count(*) FROM github_discussions WHERE node_id = $1 AND number = $2", p.Discussion.NodeID, p.Discussion.Number) != 1 {
			t.Errorf("%s: no github_discussions row for %s", name, p.Discussion.NodeID)
		}
	case "check_run":
		if count("SELECT count(*) FROM github_check_runs WHERE check_run_id = $1 AND repository = $2", p.CheckRun.ID, p.Repository.FullName) != 1 {
			t.Errorf("%s: no github_check_runs row for %d", name, p.CheckRun.ID)
		}
	case "push":
		if count("SELECT count(*) FROM github_pushes WHERE repository = $1 AND head_commit = $2 AND ref = $3", p.Repository.FullName, p.After, p.Ref) != 1 {
			t.Errorf("%s: no github_pushes row for %s", name, p.After)
		}
	case "installation", "installation_repositories":
		if count("SELECT count(*) FROM github_installations WHERE installation_id = $1", p.Installation.ID) != 1 {
			t.Errorf("%s: no github_installations row for %d", name, p.Installation.ID)
		}
		if f.Event == "installation_repositories" && count("SELECT count(*) FROM github_repositories WHERE delivery_id = $1 AND event = 'installation_repositories'", guid) == 0 {
			t.Errorf("%s: no github_repositories rows for the added or removed repositories", name)
		}
	case "repository":
		if count("SELECT count(*) FROM github_repositories WHERE delivery_id = $1 AND repository = $2 AND action = $3", guid, p.Repository.FullName, p.Action) != 1 {
			t.Errorf("%s: no github_repositories row", name)
		}
	}
}

func containsString(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// The state table, row by row, for pull requests and issues.
func TestIssueTransition(t *testing.T) {
	t.Parallel()
	tests := []struct {
		action, cur       string
		state, processing string
		change            bool
	}{
		{"opened", "", "OPEN", "NEW", true},
		{"opened", "OPEN", "OPEN", "RE_REQUESTED", true},
		{"opened", "CLOSED", "OPEN", "RE_REQUESTED", true},
		{"reopened", "", "OPEN", "NEW", true},
		{"reopened", "OPEN", "OPEN", "RE_REQUESTED", true},
		{"reopened", "CLOSED", "OPEN", "RE_REQUESTED", true},
		{"closed", "", "CLOSED", "NEW", true},
		{"closed", "OPEN", "CLOSED", "UPDATED", true},
		{"closed", "CLOSED", "", "", false},
	}
	for _, a := range []string{"synchronize", "edited", "ready_for_review", "converted_to_draft", "labeled", "unlabeled"} {
		tests = append(tests,
			struct {
				action, cur       string
				state, processing string
				change            bool
			}{a, "", "OPEN", "NEW", true},
			struct {
				action, cur       string
				state, processing string
				change            bool
			}{a, "OPEN", "OPEN", "UPDATED", true},
			struct {
				action, cur       string
				state, processing string
				change            bool
			}{a, "CLOSED", "", "", false})
	}
	for _, tt := range tests {
		state, processing, change := issueTransition(tt.action, tt.cur)
		if state != tt.state || processing != tt.processing || change != tt.change {
			t.Errorf("%s on %q: got %s/%s/%v, want %s/%s/%v", tt.action, tt.cur, state, processing, change, tt.state, tt.processing, tt.change)
		}
	}
}

// prStep is one delivery of a sequence: a fixture's action with the sequence's
// own node id and head sha.
type prStep struct {
	action, sha string
	// at is the object's updated_at, in minutes after a fixed hour; 0 means
	// the step's place in the sequence (GitHub's own order).
	at int
}

// time is the updated_at of the step at place i.
func (s prStep) time(i int) string {
	at := s.at
	if at == 0 {
		at = i + 1
	}
	return time.Date(2026, 11, 30, 12, at, 0, 0, time.UTC).Format(time.RFC3339)
}

// runSequence delivers steps for one pull request (or issue) node, in order,
// each waiting for the last, and returns its row's state, processing state,
// head sha and merged flag, and the deliveries.
func runSequence(t *testing.T, d *testDaemon, db *sql.DB, event string, steps []prStep) (state, processing, sha string, merged int, guids []string) {
	t.Helper()
	node := "node-" + randHex(6)
	for i, s := range steps {
		var body []byte
		switch {
		case event == "pull_request":
			body = loadFixture(t, "pull_request", s.action)
		case s.action == "closed":
			// There is no issues.closed fixture: a reopened one, closed.
			body = mutate(t, loadFixture(t, "issues", "reopened"), func(p map[string]any) {
				p["action"] = "closed"
				obj(p, "issue")["state"] = "closed"
			})
		default:
			body = loadFixture(t, "issues", s.action)
		}
		body = mutate(t, body, func(p map[string]any) {
			if event == "pull_request" {
				pr := obj(p, "pull_request")
				pr["node_id"], pr["updated_at"] = node, s.time(i)
				obj(pr, "head")["sha"] = s.sha
			} else {
				obj(p, "issue")["node_id"], obj(p, "issue")["updated_at"] = node, s.time(i)
			}
		})
		g := newGUID()
		guids = append(guids, g)
		postAs(t, d.URL, event, g, body, true)
		waitDatabase(t, db, g)
	}
	table := map[string]string{"pull_request": "github_pull_requests", "issues": "github_issues"}[event]
	cols := "state, processing_state, '', 0"
	if event == "pull_request" {
		cols = "state, processing_state, head_sha, merged"
	}
	if err := db.QueryRow("SELECT "+cols+" FROM "+table+" WHERE node_id = $1", node).Scan(&state, &processing, &sha, &merged); err != nil {
		t.Fatalf("row for %s: %v", node, err)
	}
	return state, processing, sha, merged, guids
}

// Pull requests and issues through sequences that only the right order gets
// right.
func TestPullRequestAndIssueSequences(t *testing.T) {
	t.Parallel()
	onBothStores(t, testPullRequestAndIssueSequences)
}

func testPullRequestAndIssueSequences(t *testing.T) {
	d, _, db := botDaemon(t)
	tests := []struct {
		event             string
		steps             []prStep
		state, processing string
		sha               string
	}{
		{"pull_request", []prStep{{action: "opened", sha: "a1"}, {action: "synchronize", sha: "a2"}, {action: "closed", sha: "a3"}}, "CLOSED", "UPDATED", "a3"},
		{"pull_request", []prStep{{action: "opened", sha: "b1"}, {action: "closed", sha: "b2"}, {action: "synchronize", sha: "b3"}}, "CLOSED", "UPDATED", "b2"},
		{"pull_request", []prStep{{action: "closed", sha: "c1"}, {action: "reopened", sha: "c2"}}, "OPEN", "RE_REQUESTED", "c2"},
		{"pull_request", []prStep{{action: "synchronize", sha: "d1"}}, "OPEN", "NEW", "d1"},
		{"pull_request", []prStep{{action: "opened", sha: "e1"}, {action: "opened", sha: "e2"}}, "OPEN", "RE_REQUESTED", "e2"},
		{"pull_request", []prStep{{action: "opened", sha: "f1"}, {action: "assigned", sha: "f2"}}, "OPEN", "NEW", "f1"},
		{"issues", []prStep{{action: "opened", sha: ""}, {action: "edited", sha: ""}, {action: "closed", sha: ""}}, "CLOSED", "UPDATED", ""},
		{"issues", []prStep{{action: "opened", sha: ""}, {action: "closed", sha: ""}, {action: "edited", sha: ""}}, "CLOSED", "UPDATED", ""},
		{"issues", []prStep{{action: "closed", sha: ""}, {action: "reopened", sha: ""}}, "OPEN", "RE_REQUESTED", ""},
		{"issues", []prStep{{action: "labeled", sha: ""}}, "OPEN", "NEW", ""},
	}
	for _, tt := range tests {
		var names []string
		for _, s := range tt.steps {
			names = append(names, s.action)
		}
		t.Run(tt.event+" "+strings.Join(names, ","), func(t *testing.T) {
			state, processing, sha, _, _ := runSequence(t, d, db, tt.event, tt.steps)
			if state != tt.state || processing != tt.processing || sha != tt.sha {
				t.Errorf("got %s/%s head %q, want %s/%s head %q", state, processing, sha, tt.state, tt.processing, tt.sha)
			}
		})
	}
	// The merged flag comes with the close.
	body := mutate(t, loadFixture(t, "pull_request", "closed"), func(p map[string]any) {
		pr := obj(p, "pull_request")
		pr["node_id"], pr["merged"] = "merged-node", true
	})
	g := newGUID()
	postAs(t, d.URL, "pull_request", g, body, true)
	waitDatabase(t, db, g)
	if n := queryInt(t, db, "SELECT merged FROM github_pull_requests WHERE node_id = 'merged-node'"); n != 1 {
		t.Errorf("merged: got %d, want 1", n)
	}
}

// A pull request's closed followed by a late synchronize whose object is
// older leaves the row closed, and records the synchronize as stale; the same
// pair in GitHub's order applies both. Comments, discussions and check runs
// keep their newer row the same way.
func TestOrderSafeRows(t *testing.T) {
	t.Parallel()
	onBothStores(t, testOrderSafeRows)
}

func testOrderSafeRows(t *testing.T) {
	d, _, db := botDaemon(t)
	outcome := func(guid string) string {
		var o string
		if err := db.QueryRow("SELECT outcome FROM worker_deliveries WHERE worker = 'database-service' AND delivery_id = $1", guid).Scan(&o); err != nil {
			t.Fatal(err)
		}
		return o
	}

	state, _, sha, _, guids := runSequence(t, d, db, "pull_request", []prStep{{"closed", "new", 20}, {"synchronize", "late", 10}})
	if state != "CLOSED" || sha != "new" {
		t.Errorf("closed then a late synchronize: got %s head %q, want CLOSED head \"new\"", state, sha)
	}
	if o := outcome(guids[1]); o != "stale" {
		t.Errorf("late synchronize: outcome %q, want stale", o)
	}
	if o := outcome(guids[0]); o != "done" {
		t.Errorf("closed: outcome %q, want done", o)
	}
	// In order: the synchronize (older) first, then closed.
	state, _, sha, _, guids = runSequence(t, d, db, "pull_request", []prStep{{"synchronize", "first", 10}, {"closed", "second", 20}})
	if state != "CLOSED" || sha != "second" || outcome(guids[0]) != "done" || outcome(guids[1]) != "done" {
		t.Errorf("in order: got %s head %q, outcomes %s, %s", state, sha, outcome(guids[0]), outcome(guids[1]))
	}

	// A comment edited twice, the newer edit first.
	edit := func(body string, at int) string {
		b := mutate(t, loadFixture(t, "issue_comment", "edited"), func(p map[string]any) {
			c := obj(p, "comment")
			c["id"], c["body"] = 777001, body
			c["updated_at"] = prStep{at: at}.time(0)
		})
		g := newGUID()
		postAs(t, d.URL, "issue_comment", g, b, true)
		waitDatabase(t, db, g)
		return g
	}
	edit("newer", 30)
	late := edit("older", 5)
	var body string
	if err := db.QueryRow("SELECT body FROM github_comments WHERE comment_id = 777001").Scan(&body); err != nil || body != "newer" {
		t.Errorf("comment after a late older edit: %q (%v), want \"newer\"", body, err)
	}
	if o := outcome(late); o != "stale" {
		t.Errorf("late comment edit: outcome %q, want stale", o)
	}

	// A lone message commits in its handler's own transaction, and is
	// counted just after: the count may trail the row by a moment.
	want := map[string]float64{"github_pull_requests": 1, "github_comments": 1, "github_check_runs": 0}
	counted := func() bool {
		metrics := scrape(t, d.URL+"/metrics")
		for table, n := range want {
			if got, ok := metrics[`switchyard_stale_events_total{table="`+table+`"}`]; !ok || got != n {
				return false
			}
		}
		return true
	}
	eventually(t, 10*time.Second, fmt.Sprintf("switchyard_stale_events_total at %v", want), counted)
}

// workflow_run requested -> in_progress -> completed, delivered in reverse
// order, ends with the completed row; the same delivery twice changes nothing.
func TestWorkflowRunOrdering(t *testing.T) {
	t.Parallel()
	onBothStores(t, testWorkflowRunOrdering)
}

func testWorkflowRunOrdering(t *testing.T) {
	d, _, db := botDaemon(t)
	base := loadFixture(t, "workflow_run", "requested")
	run := func(status, conclusion, updated string) []byte {
		return mutate(t, base, func(p map[string]any) {
			w := obj(p, "workflow_run")
			w["status"], w["updated_at"] = status, updated
			if conclusion != "" {
				w["conclusion"] = conclusion
			}
			if status == "completed" {
				p["action"] = "completed"
			}
		})
	}
	completed := run("completed", "success", "2020-10-05T16:33:49Z")
	inProgress := run("in_progress", "", "2020-10-05T16:33:30Z")
	requested := run("queued", "", "2020-10-05T16:33:24Z")
	var guids []string
	for _, b := range [][]byte{completed, inProgress, requested} {
		g := newGUID()
		guids = append(guids, g)
		postAs(t, d.URL, "workflow_run", g, b, false)
	}
	waitDatabase(t, db, guids...)
	var status, conclusion, updated, delivery string
	row := func() {
		t.Helper()
		if err := db.QueryRow("SELECT status, conclusion, github_updated_at, delivery_id FROM github_release_workflow_runs WHERE run_id = 11987344211").
			Scan(&status, &conclusion, &updated, &delivery); err != nil {
			t.Fatal(err)
		}
	}
	row()
	if status != "completed" || conclusion != "success" || delivery != guids[0] {
		t.Errorf("got %s/%s from %s, want completed/success from the first delivery", status, conclusion, delivery)
	}
	// The completed delivery again (a redelivery): nothing changes.
	postAs(t, d.URL, "workflow_run", guids[0], completed, false)
	later := newGUID()
	postAs(t, d.URL, "ping", later, loadFixture(t, "ping", "repository"), false)
	waitDatabase(t, db, later)
	before := updated
	row()
	if updated != before || delivery != guids[0] {
		t.Errorf("the repeated delivery changed the row")
	}
	if n := queryInt(t, db, "SELECT count(*) FROM worker_deliveries WHERE delivery_id = $1", guids[0]); n != 1 {
		t.Errorf("worker_deliveries for the repeated delivery: %d", n)
	}

	// A run triggered by a release is linked to its tag.
	rel := mutate(t, base, func(p map[string]any) {
		w := obj(p, "workflow_run")
		w["id"], w["event"], w["head_branch"] = 777, "release", "v1.2.3"
	})
	g := newGUID()
	postAs(t, d.URL, "workflow_run", g, rel, false)
	waitDatabase(t, db, g)
	var tag string
	if err := db.QueryRow("SELECT release_tag FROM github_release_workflow_runs WHERE run_id = 777").Scan(&tag); err != nil || tag != "v1.2.3" {
		t.Errorf("release_tag: %q %v, want v1.2.3", tag, err)
	}
}

// A row the bot is PROCESSING moves to UPDATED on a relevant Event; a
// PROCESSED row stays PROCESSED on an irrelevant one.
func TestBotProcessingStates(t *testing.T) {
	t.Parallel()
	onBothStores(t, testBotProcessingStates)
}

func testBotProcessingStates(t *testing.T) {
	d, cfg, db := botDaemon(t)
	node := "bot-node-" + randHex(4)
	withNode := func(action string) []byte {
		return mutate(t, loadFixture(t, "pull_request", action), func(p map[string]any) {
			obj(p, "pull_request")["node_id"] = node
		})
	}
	g := newGUID()
	postAs(t, d.URL, "pull_request", g, withNode("opened"), true)
	waitDatabase(t, db, g)

	// The bot takes the row, as it would, through its own connection.
	bot := openWritableDB(t, cfg.Database)
	setState := func(s string) {
		t.Helper()
		if _, err := bot.Exec("UPDATE github_pull_requests SET processing_state = $1 WHERE node_id = $2", s, node); err != nil {
			t.Fatal(err)
		}
	}
	state := func() string {
		var s string
		if err := db.QueryRow("SELECT processing_state FROM github_pull_requests WHERE node_id = $1", node).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}

	setState("PROCESSING")
	g = newGUID()
	postAs(t, d.URL, "pull_request", g, withNode("synchronize"), true)
	waitDatabase(t, db, g)
	if s := state(); s != "UPDATED" {
		t.Errorf("PROCESSING + synchronize: got %s, want UPDATED", s)
	}

	setState("PROCESSED")
	g = newGUID()
	postAs(t, d.URL, "pull_request", g, withNode("assigned"), true)
	waitDatabase(t, db, g)
	if s := state(); s != "PROCESSED" {
		t.Errorf("PROCESSED + assigned: got %s, want PROCESSED", s)
	}

	// Other tables: a check run the bot finished, requested again.
	g = newGUID()
	postAs(t, d.URL, "check_run", g, loadFixture(t, "check_run", "created"), true)
	waitDatabase(t, db, g)
	if _, err := bot.Exec("UPDATE github_check_runs SET processing_state = 'PROCESSED' WHERE check_run_id = 19204477011"); err != nil {
		t.Fatal(err)
	}
	g2, g3 := newGUID(), newGUID()
	postAs(t, d.URL, "check_run", g2, loadFixture(t, "check_run", "rerequested"), true)
	postAs(t, d.URL, "check_run", g3, loadFixture(t, "check_run", "completed"), true)
	waitDatabase(t, db, g2)
	waitDatabase(t, db, g3)
	var cs, status string
	if err := db.QueryRow("SELECT processing_state, status FROM github_check_runs WHERE check_run_id = 19204477011").Scan(&cs, &status); err != nil {
		t.Fatal(err)
	}
	if cs != "UPDATED" || status != "completed" {
		t.Errorf("check run after rerequested, completed: got %s/%s, want UPDATED/completed", cs, status)
	}
}

// A payload missing a field the tables need lands in github-database-error
// with a reason, and the worker keeps going.
func TestDatabaseServiceMissingField(t *testing.T) {
	t.Parallel()
	d, _, db := botDaemon(t)
	broken := mutate(t, loadFixture(t, "pull_request", "opened"), func(p map[string]any) {
		delete(obj(p, "pull_request"), "node_id")
	})
	badGUID, good := newGUID(), newGUID()
	postAs(t, d.URL, "pull_request", badGUID, broken, true)
	postAs(t, d.URL, "pull_request", good, loadFixture(t, "pull_request", "opened"), true)
	waitDatabase(t, db, good)
	vhost := d.brokers.List()[0].Vhost
	eventually(t, 10*time.Second, "the broken message in github-database-error", func() bool {
		return ready(t, vhost, errorQueue(queueDatabase)) == 1
	})
	m := getOne(t, vhost, errorQueue(queueDatabase))
	if m.MessageId != badGUID || !strings.Contains(tableString(m.Headers, hdrErrorReason), "node_id") {
		t.Errorf("error message %s with reason %q", m.MessageId, tableString(m.Headers, hdrErrorReason))
	}
	// The raw log still has it: the service worker does not need the field.
	eventually(t, 10*time.Second, "raw row stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", badGUID) == 1
	})
	if n := queryInt(t, db, "SELECT count(*) FROM worker_deliveries WHERE delivery_id = $1", badGUID); n != 0 {
		t.Errorf("the broken delivery was marked done")
	}
}

// DecodeEvent decodes a payload once, into the type the typed tables read
// for its name (newTablePayload): over every payload, as a bot Event, the
// rows come from that one pass alone (with the payload gone they are the
// same) and are the rows of decoding the payload anew for each decoder, as
// an Event built by hand is.
func TestTablePayloadsInOnePass(t *testing.T) {
	t.Parallel()
	fixtures := loadFixtures(t)
	if compared := compareOnePass(t, fixtures); compared != len(fixtures) {
		t.Errorf("compared %d of %d payloads; every one of testdata should decode", compared, len(fixtures))
	}
}

// recordedCorpus is a corpus of payloads recorded from GitHub (octokit's
// webhooks fixtures), laid beside the repository on the machines that have
// it. Nothing but TestRecordedCorpus reads it.
const recordedCorpus = "../shared/fixtures/github-payloads"

// The decoders and the typed tables' payload types agree over every
// payload GitHub was recorded sending, when such a corpus is at hand.
func TestRecordedCorpus(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat(recordedCorpus); err != nil {
		t.Skipf("no recorded corpus at %s: %v", recordedCorpus, err)
	}
	fixtures := readFixtures(t, recordedCorpus)
	if compared := compareOnePass(t, fixtures); compared < len(fixtures)*3/4 {
		t.Errorf("compared %d of %d recorded payloads, want most of them", compared, len(fixtures))
	}
}

// compareOnePass checks TestTablePayloadsInOnePass's claim over fixtures
// and returns how many decoded.
func compareOnePass(t *testing.T, fixtures []fixture) (compared int) {
	t.Helper()
	for _, f := range fixtures {
		msg := eventMessage(f.Event, "fixture-"+f.Event+"-"+f.Name, f.Body)
		msg.Headers[hdrTargetType], msg.Headers[hdrTargetID] = "integration", strconv.Itoa(testBotAppID)
		ev, src, err := readEvent(delivered(msg))
		if err != nil {
			continue // a payload the workers refuse reaches no table
		}
		onePass := *ev
		onePass.Payload = nil
		want, wantErr := decodeTableRows(ev, decodedPayload{}, testBotAppID)
		for name, e := range map[string]*Event{"the one pass": ev, "the one pass alone": &onePass} {
			got, err := decodeTableRows(e, src, testBotAppID)
			if (err == nil) != (wantErr == nil) {
				t.Errorf("%s/%s: %s: %v, decoded anew: %v", f.Event, f.Name, name, err, wantErr)
				continue
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("%s/%s: rows from %s differ:\n got %+v\nwant %+v", f.Event, f.Name, name, got, want)
			}
		}
		compared++
	}
	return compared
}

// Every payload of testdata/payloads/malformed is refused for good: by
// DecodeEvent, or by the typed tables of a bot Event; never a retry.
func TestMalformedPayloads(t *testing.T) {
	t.Parallel()
	paths, err := filepath.Glob(filepath.Join(payloadDir, "malformed", "*.json"))
	if err != nil || len(paths) < 10 {
		t.Fatalf("malformed payloads: %d found, %v", len(paths), err)
	}
	for _, p := range paths {
		event, _, _ := strings.Cut(filepath.Base(p), ".")
		t.Run(filepath.Base(p), func(t *testing.T) {
			body, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			msg := eventMessage(event, "malformed-"+filepath.Base(p), body)
			msg.Headers[hdrTargetType], msg.Headers[hdrTargetID] = "integration", strconv.Itoa(testBotAppID)
			d, err := DecodeTableRows(delivered(msg), testBotAppID)
			if err == nil {
				err = d.RowsErr
			}
			if !errors.As(verdict(err), new(*permanentError)) {
				t.Fatalf("got %v, want a permanent failure", err)
			}
		})
	}
}

// On PostgreSQL a consumer's batch sends its statements ahead of their
// answers (Tx.Pipeline), which it knows or guesses: the database worker's
// batch of new pull requests takes a few round trips, where a statement at
// a time takes two a message. A batch in which a guess misses (a delivery
// done before) runs again a statement at a time, each message with its own
// verdict, beside an older Event; so does one with a payload missing a
// field. And a guess that missed then rests: the next batch with a
// delivery done before reads the answers instead of running twice.
func TestBatchSendsAhead(t *testing.T) {
	t.Parallel()
	needPostgres(t)
	ctx := context.Background()
	cfg := postgresConfig(t)
	u, err := url.Parse(cfg.URL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := newTCPProxy(t, u.Host)
	trips := proxy.countRoundTrips()
	u.Host = proxy.addr
	cfg.URL = u.String()
	store, err := OpenStore(ctx, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	if _, _, err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	o := EventOptions{Queue: queueDatabase, Handle: databaseHandler(testBotAppID),
		Decode: databaseDecode(testBotAppID), Batch: store, Log: log}
	pr := func(guid, node, updated string, edit func(pr map[string]any)) Message {
		return botPullRequest(t, guid, node, updated, edit)
	}
	const n = 40
	var msgs []Message
	for i := range n {
		msgs = append(msgs, pr(fmt.Sprintf("ahead-%d", i), fmt.Sprintf("node-ahead-%d", i), "2024-06-01T10:00:00Z", nil))
	}
	before := trips.Load()
	verdicts, err := o.handleBatch(ctx, msgs)
	if err != nil {
		t.Fatal(err)
	}
	for i, v := range verdicts {
		if v != nil {
			t.Fatalf("message %d: %v", i, v)
		}
	}
	// Two a message sent one at a time, begin and commit: 2n+2 and more.
	// A statement at a time: two a message, begin and commit.
	if got := trips.Load() - before; got > n/4 {
		t.Errorf("a batch of %d new pull requests took %d round trips, want a few", n, got)
	}
	db := openStoreDB(t, cfg)
	if got := queryInt(t, db, "SELECT count(*) FROM github_pull_requests WHERE node_id LIKE 'node-ahead-%'"); got != n {
		t.Fatalf("%d pull request rows of %d", got, n)
	}

	mixed := []Message{
		pr("mixed-new-1", "node-mixed-1", "2024-06-01T10:00:00Z", nil),
		msgs[0], // done before: its mark is answered with no row
		pr("mixed-new-2", "node-mixed-2", "2024-06-01T10:00:00Z", nil),
		pr("mixed-older", "node-ahead-1", "2024-05-01T10:00:00Z", func(p map[string]any) { p["title"] = "older" }),
		pr("mixed-new-3", "node-mixed-4", "2024-06-01T10:00:00Z", nil),
	}
	verdicts, err = o.handleBatch(ctx, mixed)
	if err != nil {
		t.Fatal(err)
	}
	for i, v := range verdicts {
		switch want := mixed[i].ID; {
		case want == msgs[0].ID:
			if !errors.Is(v, ErrDuplicate) {
				t.Errorf("the delivery done before: %v, want a duplicate", v)
			}
		case v != nil:
			t.Errorf("%s: %v", want, v)
		}
	}
	var outcome, title string
	if err := db.QueryRow("SELECT outcome FROM worker_deliveries WHERE worker = 'database-service' AND delivery_id = 'mixed-older'").Scan(&outcome); err != nil || outcome != "stale" {
		t.Errorf("the older Event: outcome %q (%v), want stale", outcome, err)
	}
	if err := db.QueryRow("SELECT title FROM github_pull_requests WHERE node_id = 'node-ahead-1'").Scan(&title); err != nil || title == "older" {
		t.Errorf("the older Event wrote its title over the newer row's (%v)", err)
	}
	if got := queryInt(t, db, "SELECT count(*) FROM github_pull_requests WHERE node_id IN ('node-mixed-1', 'node-mixed-2', 'node-mixed-4')"); got != 3 {
		t.Errorf("%d of the 3 new pull requests beside them stored", got)
	}
	if got := queryInt(t, db, "SELECT count(*) FROM worker_deliveries WHERE delivery_id = $1", msgs[0].ID); got != 1 {
		t.Errorf("the delivery done before marked %d times", got)
	}

	// A payload missing a field fails alone (before its statements: the
	// batch runs again with savepoints).
	broken := []Message{
		pr("broken-new-1", "node-broken-1", "2024-06-01T10:00:00Z", nil),
		pr("broken", "node-broken-2", "2024-06-01T10:00:00Z", func(p map[string]any) { delete(p, "node_id") }),
		pr("broken-new-2", "node-broken-3", "2024-06-01T10:00:00Z", nil),
	}
	if verdicts, err = o.handleBatch(ctx, broken); err != nil {
		t.Fatal(err)
	}
	var pe *permanentError
	if verdicts[0] != nil || !errors.As(verdicts[1], &pe) || verdicts[2] != nil {
		t.Errorf("a batch with a payload without node_id: verdicts %v, want nil, permanent, nil", verdicts)
	}
	if got := queryInt(t, db, "SELECT count(*) FROM github_pull_requests WHERE node_id LIKE 'node-broken-%'"); got != 2 {
		t.Errorf("%d of the 2 new pull requests beside the broken one stored", got)
	}

	// The guesses rest: the answers are read, two round trips a message,
	// where a batch run again takes four a message and more.
	var next []Message
	for i := range n {
		next = append(next, pr(fmt.Sprintf("rest-%d", i), fmt.Sprintf("node-rest-%d", i), "2024-06-01T10:00:00Z", nil))
	}
	next[n/2] = msgs[2]
	before = trips.Load()
	if verdicts, err = o.handleBatch(ctx, next); err != nil {
		t.Fatal(err)
	}
	for i, v := range verdicts {
		if i == n/2 && !errors.Is(v, ErrDuplicate) || i != n/2 && v != nil {
			t.Errorf("after the misses, message %d: %v", i, v)
		}
	}
	if got := trips.Load() - before; got >= 3*n {
		t.Errorf("a batch with a delivery done before, right after a miss, took %d round trips for %d messages: it ran twice", got, n)
	}
}

// A batch run again (a message in it fails before the statements the
// batch sent ahead: it runs again with savepoints) records what its
// handlers found once, after its commit: the stale Event's counter and
// log line are not doubled.
func TestBatchRunAgainRecordsOnce(t *testing.T) {
	t.Parallel()
	onBothStores(t, func(t *testing.T) {
		ctx := context.Background()
		store := migratedStore(t)
		metrics := NewMetrics(MetricLabels{Version: "test", Queues: logicalQueues, Tables: orderSafeTables, Outcomes: outcomes})
		var recorded atomic.Int64
		record := databaseRecord(metrics)
		runs := map[string]int{} // the handler's runs, by GUID
		handle := databaseHandler(testBotAppID)
		counted := func(ctx context.Context, tx *Tx, d Decoded) (Found, error) {
			runs[d.Event.DeliveryID]++
			return handle(ctx, tx, d)
		}
		o := EventOptions{Queue: queueDatabase, Handle: counted, Decode: databaseDecode(testBotAppID),
			Batch: store, Log: slog.New(slog.DiscardHandler), Record: func(log *slog.Logger, f Found) {
				if f.Stale != "" {
					recorded.Add(1)
				}
				record(log, f)
			}}
		pr := func(guid, node, updated string, edit func(pr map[string]any)) Message {
			return botPullRequest(t, guid, node, updated, edit)
		}
		if v, err := o.handleBatch(ctx, []Message{pr("newer", "node-1", "2024-06-01T10:00:00Z", nil)}); err != nil || v[0] != nil {
			t.Fatalf("the newer Event: %v %v", v, err)
		}
		batch := []Message{
			pr("older", "node-1", "2024-05-01T10:00:00Z", nil),
			pr("broken", "node-2", "2024-06-01T10:00:00Z", func(p map[string]any) { delete(p, "node_id") }),
			pr("other", "node-3", "2024-06-01T10:00:00Z", nil),
		}
		verdicts, err := o.handleBatch(ctx, batch)
		if err != nil {
			t.Fatal(err)
		}
		if verdicts[0] != nil || !errors.As(verdicts[1], new(*permanentError)) || verdicts[2] != nil {
			t.Fatalf("verdicts %v, want nil, permanent, nil", verdicts)
		}
		// The batch was written twice: its first run ended at the broken
		// part, so the part before it ran again in the second; the broken
		// one ran once, the one after it once (the first run never came
		// to it).
		if runs["older"] != 2 || runs["broken"] != 1 || runs["other"] != 1 {
			t.Errorf("the handler's runs %v, want older 2, broken 1, other 1", runs)
		}
		// What the handler ran twice for landed once: one mark of each
		// delivery written, the newer Event's row kept, the other's row.
		for guid, want := range map[string]int{"newer": 1, "older": 1, "broken": 0, "other": 1} {
			if n := queryInt(t, store.r, "SELECT count(*) FROM worker_deliveries WHERE worker = 'database-service' AND delivery_id = $1", guid); n != want {
				t.Errorf("%d marks of %s, want %d", n, guid, want)
			}
		}
		if n := queryInt(t, store.r, "SELECT count(*) FROM github_pull_requests WHERE node_id IN ('node-1', 'node-3')"); n != 2 {
			t.Errorf("%d pull request rows of node-1 and node-3, want 2", n)
		}
		if n := recorded.Load(); n != 1 {
			t.Errorf("the stale Event recorded %d times, want once", n)
		}
		srv := httptest.NewServer(metrics.Handler())
		defer srv.Close()
		if n := scrape(t, srv.URL)[`switchyard_stale_events_total{table="github_pull_requests"}`]; n != 1 {
			t.Errorf("switchyard_stale_events_total{table=github_pull_requests} = %v, want 1", n)
		}
	})
}

// botPullRequest is a message of a pull_request.opened delivered to the
// bot App's hook, of pull request node updated at updated, edit changing
// its pull_request object further when set.
func botPullRequest(t *testing.T, guid, node, updated string, edit func(pr map[string]any)) Message {
	t.Helper()
	body := mutate(t, loadFixture(t, "pull_request", "opened"), func(p map[string]any) {
		obj(p, "pull_request")["node_id"] = node
		obj(p, "pull_request")["updated_at"] = updated
		if edit != nil {
			edit(obj(p, "pull_request"))
		}
	})
	m := eventMessage("pull_request", guid, body)
	m.Headers[hdrTargetType], m.Headers[hdrTargetID] = "integration", strconv.Itoa(testBotAppID)
	return Message{ID: m.MessageId, Type: m.Type, Headers: m.Headers, Body: m.Body, Timestamp: m.Timestamp}
}
