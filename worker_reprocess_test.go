package main

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// typedTables are every table reprocess derives: release tracking and the
// bot's tables.
var typedTables = append([]string{"github_releases", "github_release_workflow_runs"}, botTables...)

// typedSnapshot reads every typed row, keyed by table, in a stable order;
// with volatile, the columns of when a row was written (created_at,
// updated_at, processing_date) are kept, else left out.
func typedSnapshot(t *testing.T, db *sql.DB, volatile bool) map[string][]map[string]any {
	t.Helper()
	out := map[string][]map[string]any{}
	for _, table := range typedTables {
		rows, err := db.Query("SELECT * FROM " + table)
		if err != nil {
			t.Fatal(err)
		}
		cols, _ := rows.Columns()
		var all []map[string]any
		for rows.Next() {
			vals := scanAny(t, rows, len(cols))
			row := map[string]any{}
			for i, c := range cols {
				switch c {
				case "id":
					continue // an identity, given anew to a row inserted again
				case "created_at", "updated_at", "processing_date":
					if !volatile {
						continue
					}
				}
				v := vals[i]
				if b, ok := v.([]byte); ok {
					v = string(b)
				}
				row[c] = fmt.Sprint(v)
			}
			all = append(all, row)
		}
		rows.Close()
		slices.SortFunc(all, func(a, b map[string]any) int { return strings.Compare(fmt.Sprint(a), fmt.Sprint(b)) })
		out[table] = all
	}
	return out
}

// deleteTyped empties every typed table.
func deleteTyped(t *testing.T, cfg DatabaseConfig) {
	t.Helper()
	db := openWritableDB(t, cfg)
	for _, table := range typedTables {
		if _, err := db.Exec("DELETE FROM " + table); err != nil {
			t.Fatal(err)
		}
	}
}

// The typed tables deleted, reprocess brings them back from the raw log as
// database-service wrote them, each issue's and pull request's last state
// in received order (ties of updated_at included); -dry-run writes
// nothing; a second run changes nothing; serve stores webhooks between its
// batches; and the summary says what it skipped and why.
func TestReprocess(t *testing.T) {
	t.Parallel()
	onBothStores(t, testReprocess)
}

func testReprocess(t *testing.T) {
	d, cfg, db := botDaemon(t)
	// Sequences whose last state only the received order gives: the
	// issue's opened and labeled, and its closed and reopened, share
	// their updated_at.
	runSequence(t, d, db, "pull_request", []prStep{{action: "opened", sha: "a1"}, {action: "synchronize", sha: "a2"}, {action: "closed", sha: "a3"}})
	runSequence(t, d, db, "issues", []prStep{{action: "opened", at: 5}, {action: "labeled", at: 5}, {action: "closed", at: 6}, {action: "reopened", at: 6}})
	var guids []string
	post := func(event, fixture string, bot bool, edit func(p map[string]any)) string {
		body := loadFixture(t, event, fixture)
		if edit != nil {
			body = mutate(t, body, edit)
		}
		g := newGUID()
		postAs(t, d.URL, event, g, body, bot)
		guids = append(guids, g)
		return g
	}
	post("release", "published", false, nil) // release tracking: every repository's
	post("push", "branch", true, nil)        // a bot table
	post("issues", "opened", false, nil)     // not the bot App's copy
	post("ping", "app", true, nil)           // no typed table
	pruned := post("issues", "labeled", true, func(p map[string]any) { obj(p, "issue")["node_id"] = "pruned-node" })
	// Reprocess reads the raw log: each delivery's github row (the
	// service worker's) as well as its typed rows (database-service's).
	stored := func(guids ...string) {
		t.Helper()
		waitDatabase(t, db, guids...)
		eventually(t, 30*time.Second, "every raw row stored", func() bool {
			for _, g := range guids {
				if queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", g) == 0 {
					return false
				}
			}
			return true
		})
	}
	stored(guids...)

	w := openWritableDB(t, cfg.Database)
	if res, err := w.Exec("UPDATE github SET payload = '', payload_zstd = NULL, payload_pruned_at = received_at WHERE delivery_id = $1", pruned); err != nil {
		t.Fatal(err)
	} else if n, _ := res.RowsAffected(); n != 1 {
		t.Fatalf("pruned %d raw rows, want 1", n)
	}
	// A raw row whose payload the tables cannot read: a pull request that
	// is not an object.
	if _, err := w.Exec(`INSERT INTO github (delivery_id, event, action, hook_id, target_type, target_id, payload, received_at, processed_at)
		VALUES ($1, 'pull_request', 'opened', 7, 'integration', $2, '{"action": "opened", "pull_request": "no"}', $3, $3)`,
		newGUID(), testBotAppID, formatTime(time.Now())); err != nil {
		t.Fatal(err)
	}
	want := typedSnapshot(t, db, false)
	want["github_issues"] = slices.DeleteFunc(want["github_issues"], func(r map[string]any) bool { return r["node_id"] == "pruned-node" })
	if len(want["github_pull_requests"]) != 1 || len(want["github_issues"]) != 1 || len(want["github_releases"]) != 1 || len(want["github_pushes"]) != 1 {
		t.Fatalf("the deliveries did not write what the test expects: %v", want)
	}
	deleteTyped(t, cfg.Database)

	store, err := OpenStore(context.Background(), cfg.Database, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	run := func(o ReprocessOptions) ReprocessSummary {
		t.Helper()
		sum, err := Reprocess(context.Background(), store, testBotAppID, o, log)
		if err != nil {
			t.Fatalf("reprocess: %v", err)
		}
		return sum
	}

	// -dry-run: what it would change, and nothing written.
	var out bytes.Buffer
	if err := reprocess(context.Background(), cfg, ReprocessFlags{DryRun: true}, log, &out); err != nil {
		t.Fatal(err)
	}
	t.Logf("dry run:\n%s", out.String())
	if !strings.Contains(out.String(), "would change typed rows") || !strings.Contains(out.String(), "nothing written") {
		t.Errorf("dry run's summary:\n%s", out.String())
	}
	for table, rows := range typedSnapshot(t, db, false) {
		if len(rows) > 0 {
			t.Errorf("dry run wrote %d rows to %s", len(rows), table)
		}
	}

	// The run, 3 raw rows a batch; between its first batches, a webhook
	// is taken and stored by serve.
	during := ""
	sum := run(ReprocessOptions{Batch: 3, Progress: func(s ReprocessSummary) {
		if during == "" {
			during = post("issues", "opened", true, func(p map[string]any) { obj(p, "issue")["node_id"] = "during-node" })
			stored(during)
		}
	}})
	t.Logf("run: %+v", sum)
	got := typedSnapshot(t, db, false)
	got["github_issues"] = slices.DeleteFunc(got["github_issues"], func(r map[string]any) bool { return r["node_id"] == "during-node" })
	for _, table := range slices.Sorted(maps.Keys(want)) {
		if !reflect.DeepEqual(got[table], want[table]) {
			t.Errorf("%s after reprocess:\n got %v\nwant %v", table, got[table], want[table])
		}
	}
	if n := queryInt(t, db, "SELECT count(*) FROM github_issues WHERE node_id = 'during-node'"); n != 1 {
		t.Errorf("the webhook taken during the run: %d typed rows, want 1", n)
	}
	// The webhook taken during the run came after the count, and was read
	// too: serve had written its rows.
	if sum.Seen != sum.Total+1 || sum.Written != 9 || sum.Unchanged != 1 {
		t.Errorf("run: seen %d of %d, written %d, unchanged %d; want all and the one taken during it, 9 written, 1 unchanged",
			sum.Seen, sum.Total, sum.Written, sum.Unchanged)
	}
	for reason, n := range map[string]int64{skipPruned: 1, skipNotBot: 1, skipUndecoded: 1, skipNoTable: 1} {
		if sum.Skipped[reason] != n {
			t.Errorf("skipped %q: %d, want %d (all: %v)", reason, sum.Skipped[reason], n, sum.Skipped)
		}
	}

	// A second run changes nothing, not even when a row was written.
	before := typedSnapshot(t, db, true)
	again := run(ReprocessOptions{})
	if again.Written != 0 || again.Unchanged == 0 {
		t.Errorf("second run: %+v, want nothing written", again)
	}
	if after := typedSnapshot(t, db, true); !reflect.DeepEqual(after, before) {
		t.Errorf("second run changed rows:\n got %v\nwant %v", after, before)
	}

	// -event narrows, and the command prints the summary.
	out.Reset()
	if err := reprocess(context.Background(), cfg, ReprocessFlags{Event: "release", Since: time.Hour}, log, &out); err != nil {
		t.Fatal(err)
	}
	if said := strings.Join(strings.Fields(out.String()), " "); !strings.Contains(said, "raw rows read 1 of 1") ||
		!strings.Contains(said, "changed typed rows 0") {
		t.Errorf("reprocess -event release:\n%s", out.String())
	}
	if err := reprocess(context.Background(), cfg, ReprocessFlags{Event: "Pull-Request"}, log, &out); err == nil {
		t.Error("reprocess -event Pull-Request: no error")
	}
}
