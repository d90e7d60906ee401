package main

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// DeliveryStory is what the database knows of one event's deliveries:
// GitHub's attempts, each hook's copy (its raw row, what each worker made
// of it, the typed rows it wrote), its redelivery through github-hooks,
// its gap, and its alerts. GitHub sends one event to every hook that
// subscribes to it under one GUID; each hook's copy is a delivery of its
// own.
type DeliveryStory struct {
	GUID string `json:"guid"`
	// GitHub are GitHub's attempts at the App's copy, oldest first, as the
	// hooks poll listed them (with the GitHub App configured, for 72 hours).
	GitHub []StoryAttempt `json:"github_attempts"`
	// Rejected are the webhooks of this GUID that were refused here (401,
	// 400, 413, 503), oldest first.
	Rejected []Rejection `json:"rejected"`
	// Queued are the times a webhook of this GUID went through the
	// outbox (committed at the door, published after), oldest first, kept
	// 7 days.
	Queued []OutboxStory `json:"queued"`
	// Copies are the hooks' copies known here, in the order they were stored.
	Copies []StoryCopy  `json:"copies"`
	Hooks  *StoryHooks  `json:"redelivered_through_hooks,omitempty"`
	Gap    *deliveryGap `json:"gap,omitempty"`
	// Alerts are the event's, sent once at its first copy.
	Alerts []StoryAlert `json:"alerts"`
	// Errors are its messages waiting in -error and -retry queues
	// (`deliveries show` looks; the store does not know them).
	Errors []StoryError `json:"waiting_in_error_queues,omitempty"`
}

// StoryCopy is one hook's copy of the event: its raw row when stored, what
// each worker made of it, the typed rows it wrote.
type StoryCopy struct {
	Hook     int64         `json:"hook_id"`
	Received *StoryReceipt `json:"received,omitempty"`
	Workers  []StoryWorker `json:"workers"`
	Rows     []StoryRow    `json:"typed_rows"`
	Payload  string        `json:"-"`
}

// StoryAttempt is one of GitHub's attempts at the delivery: when, and the
// answer GitHub recorded.
type StoryAttempt struct {
	Hook        int64     `json:"hook"` // the hook whose ledger listed it: 0 for the App's
	ID          int64     `json:"id"`
	DeliveredAt time.Time `json:"delivered_at"`
	StatusCode  int       `json:"status_code"`
	Status      string    `json:"status"`
	Redelivery  bool      `json:"redelivery"`
}

// maxStoryAttempts bounds the attempts a story lists.
const maxStoryAttempts = 50

// maxStoryCopies bounds the hooks' copies a story lists: GitHub sends an
// event to each of a few hooks, and the rest would only be a long page.
const maxStoryCopies = 50

// StoryError is one message of the delivery in an -error or -retry queue.
type StoryError struct {
	Broker   int    `json:"broker"`
	Queue    string `json:"queue"`
	Hook     int64  `json:"hook_id"`
	Reason   string `json:"reason"`
	Attempts string `json:"attempts,omitempty"`
}

// StoryReceipt is the copy's raw github row, without the payload.
type StoryReceipt struct {
	Event      string `json:"event"`
	Action     string `json:"action,omitempty"`
	Repository string `json:"repository,omitempty"`
	Sender     string `json:"sender,omitempty"`
	SourceIP   string `json:"source_ip,omitempty"`
	Forbidden  bool   `json:"forbidden"`
	TargetType string `json:"target_type,omitempty"`
	TargetID   int64  `json:"target_id,omitempty"`
	// Broker is the broker ("host/vhost") it came through to the worker
	// that stored it.
	Broker string `json:"broker,omitempty"`
	// TraceID is the trace of its delivery (tracing), and TraceURL its
	// page when [tracing] ui_url names one.
	TraceID      string     `json:"trace_id,omitempty"`
	TraceURL     string     `json:"trace_url,omitempty"`
	ReceivedAt   time.Time  `json:"received_at"`
	StoredAt     time.Time  `json:"stored_at"`
	PayloadBytes int        `json:"payload_bytes"`
	PrunedAt     *time.Time `json:"payload_pruned_at,omitempty"`
	// Unreadable says why the stored payload could not be given back (it
	// does not decompress): reported, the rest of the story told.
	Unreadable string `json:"payload_unreadable,omitempty"`
	// Duplicates is how often this hook's copy came again after it was
	// stored, the last time at LastDuplicateAt.
	Duplicates      int        `json:"duplicates,omitempty"`
	LastDuplicateAt *time.Time `json:"last_duplicate_at,omitempty"`
}

// StoryWorker is one worker's record of the delivery.
type StoryWorker struct {
	Worker  string    `json:"worker"`
	Outcome string    `json:"outcome"` // done or stale
	At      time.Time `json:"at"`
}

// StoryRow is one typed row the delivery wrote (or last wrote).
type StoryRow struct {
	Table string `json:"table"`
	Key   string `json:"key"`
}

// StoryHooks is the delivery's redelivery through github-hooks.
type StoryHooks struct {
	QueuedAt      time.Time  `json:"queued_at"`
	RepublishedAt *time.Time `json:"republished_at,omitempty"`
}

// StoryAlert is one alert of the delivery, per channel.
type StoryAlert struct {
	Channel   string     `json:"channel"`
	SentAt    *time.Time `json:"sent_at,omitempty"`
	LastError string     `json:"last_error,omitempty"`
}

// ErrUnknownDelivery is a GUID the database has no record of.
var ErrUnknownDelivery = errorKind(CodeNotFound, "no delivery with this GUID is known")

// newStory is an empty story of guid, its lists empty rather than null.
func newStory(guid string) *DeliveryStory {
	return &DeliveryStory{GUID: guid, GitHub: []StoryAttempt{}, Rejected: []Rejection{}, Queued: []OutboxStory{}, Copies: []StoryCopy{}, Alerts: []StoryAlert{}}
}

// copyOf is the story's copy for hook, added when there is none yet.
func (st *DeliveryStory) copyOf(hook int64) *StoryCopy {
	for i := range st.Copies {
		if st.Copies[i].Hook == hook {
			return &st.Copies[i]
		}
	}
	st.Copies = append(st.Copies, StoryCopy{Hook: hook, Workers: []StoryWorker{}, Rows: []StoryRow{}})
	return &st.Copies[len(st.Copies)-1]
}

// LinkTraces gives each copy's trace its page: ui is [tracing] ui_url, a
// template with {trace_id} in it ("" for none).
func (st *DeliveryStory) LinkTraces(ui string) {
	for _, c := range st.Copies {
		if r := c.Received; ui != "" && r != nil && r.TraceID != "" {
			r.TraceURL = strings.ReplaceAll(ui, "{trace_id}", r.TraceID)
		}
	}
}

// Narrow keeps only hook's copy, its refusals, and the messages of it
// waiting in queues. A hook with neither a copy nor a refusal known is
// ErrUnknownDelivery.
func (st *DeliveryStory) Narrow(hook int64) error {
	st.Rejected = slices.DeleteFunc(st.Rejected, func(r Rejection) bool { return r.Hook != HookID(hook) })
	st.Queued = slices.DeleteFunc(st.Queued, func(q OutboxStory) bool { return q.Hook != HookID(hook) })
	st.Errors = slices.DeleteFunc(st.Errors, func(e StoryError) bool { return e.Hook != hook })
	copies := st.Copies
	st.Copies = []StoryCopy{}
	for _, c := range copies {
		if c.Hook == hook {
			st.Copies = append(st.Copies, c)
		}
	}
	if len(st.Copies) == 0 && len(st.Rejected) == 0 {
		return errorf(CodeNotFound, "%s: %s for hook %d", ErrUnknownDelivery.Message, st.GUID, hook)
	}
	return nil
}

// Payload is the payload of the first stored copy, the one a page shows.
func (st *DeliveryStory) Payload() string {
	for _, c := range st.Copies {
		if c.Received != nil {
			return c.Payload
		}
	}
	return ""
}

// storyTables are the typed tables that keep the delivery that wrote a
// row, the column that names the row, and whether they keep the hook whose
// copy wrote it. Release tracking reads every copy and keeps no hook: its
// rows are told with the first copy.
var storyTables = []struct {
	table, key string
	hooked     bool
}{
	{"github_releases", "release_id", false}, {"github_release_workflow_runs", "run_id", false},
	{"github_branches", "ref", true}, {"github_issues", "node_id", true},
	{"github_pull_requests", "node_id", true}, {"github_comments", "comment_id", true},
	{"github_discussions", "node_id", true}, {"github_check_runs", "check_run_id", true},
	{"github_pushes", "head_commit", true}, {"github_installations", "installation_id", true},
	{"github_repositories", "repository", true},
}

// Story reads everything the database knows of guid's deliveries, in one
// read transaction so that its parts agree with each other.
func (s *Store) Story(ctx context.Context, guid string) (*DeliveryStory, error) {
	tx, err := s.snapshot(ctx)
	if err != nil {
		return nil, fmt.Errorf("read a story: %w", err)
	}
	defer tx.done()
	st := newStory(guid)
	each := func(what, query string, scan func(*sql.Rows) error, args ...any) error {
		rows, err := tx.rows(ctx, query, args...)
		if err != nil {
			return fmt.Errorf("read %s: %w", what, err)
		}
		defer rows.Close()
		for rows.Next() {
			if err := scan(rows); err != nil {
				return fmt.Errorf("read %s: %w", what, err)
			}
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("read %s: %w", what, err)
		}
		return nil
	}
	err = each("github", `SELECT hook_id, event, action, repository, sender, source_ip, forbidden, target_type, target_id,
		received_at, processed_at, payload, payload_zstd, payload_pruned_at, duplicates, last_duplicate_at, broker, coalesce(trace_id, '')
		FROM github WHERE delivery_id = $1 ORDER BY id LIMIT $2`, func(rows *sql.Rows) error {
		var r StoryReceipt
		var hook int64
		var received, stored, text string
		var compressed []byte
		var targetID sql.NullInt64
		var pruned, lastDup sql.NullString
		if err := rows.Scan(&hook, &r.Event, &r.Action, &r.Repository, &r.Sender, &r.SourceIP, &r.Forbidden, &r.TargetType, &targetID,
			&received, &stored, &text, &compressed, &pruned, &r.Duplicates, &lastDup, &r.Broker, &r.TraceID); err != nil {
			return err
		}
		payload, err := rowPayload(text, compressed)
		if err != nil {
			r.Unreadable = err.Error()
		}
		r.TargetID, r.PayloadBytes, r.PrunedAt = targetID.Int64, len(payload), parseTimePtr(pruned)
		r.LastDuplicateAt = parseTimePtr(lastDup)
		r.ReceivedAt, _ = time.Parse(time.RFC3339Nano, received)
		r.StoredAt, _ = time.Parse(time.RFC3339Nano, stored)
		c := st.copyOf(hook)
		c.Received, c.Payload = &r, string(payload)
		return nil
	}, guid, maxStoryCopies)
	if err != nil {
		return nil, err
	}
	err = each("github_attempts", `SELECT hook_id, attempt_id, delivered_at, status_code, status, redelivery FROM github_attempts
		WHERE guid = $1 ORDER BY delivered_at, attempt_id LIMIT $2`, func(rows *sql.Rows) error {
		var a StoryAttempt
		var at string
		if err := rows.Scan(&a.Hook, &a.ID, &at, &a.StatusCode, &a.Status, &a.Redelivery); err != nil {
			return err
		}
		a.DeliveredAt, _ = time.Parse(time.RFC3339Nano, at)
		st.GitHub = append(st.GitHub, a)
		return nil
	}, guid, maxStoryAttempts)
	if err != nil {
		return nil, err
	}
	rejected, err := rejectionsOf(ctx, tx, guid)
	if err != nil {
		return nil, err
	}
	st.Rejected = append(st.Rejected, rejected...)
	inOutbox, err := queuedOf(ctx, tx, guid)
	if err != nil {
		return nil, err
	}
	st.Queued = append(st.Queued, inOutbox...)
	err = each("worker_deliveries", `SELECT hook_id, worker, outcome, processed_at FROM worker_deliveries
		WHERE delivery_id = $1 ORDER BY hook_id, worker LIMIT $2`, func(rows *sql.Rows) error {
		var w StoryWorker
		var hook int64
		var at string
		if err := rows.Scan(&hook, &w.Worker, &w.Outcome, &at); err != nil {
			return err
		}
		w.At, _ = time.Parse(time.RFC3339Nano, at)
		if w.Worker == "hooks" {
			// The hooks worker's record is of the App's delivery,
			// told by the redelivery line; it keeps no hook.
			return nil
		}
		c := st.copyOf(hook)
		c.Workers = append(c.Workers, w)
		return nil
	}, guid, maxStoryCopies*4)
	if err != nil {
		return nil, err
	}
	for _, t := range storyTables {
		hook := "NULL"
		if t.hooked {
			hook = "coalesce(hook_id, 0)"
		}
		err := each(t.table, "SELECT "+hook+", "+t.key+" FROM "+t.table+" WHERE delivery_id = $1", func(rows *sql.Rows) error {
			var hook sql.NullInt64
			var k any
			if err := rows.Scan(&hook, &k); err != nil {
				return err
			}
			var c *StoryCopy
			if !t.hooked && len(st.Copies) > 0 {
				c = &st.Copies[0]
			} else {
				c = st.copyOf(hook.Int64)
			}
			c.Rows = append(c.Rows, StoryRow{Table: t.table, Key: fmt.Sprint(k)})
			return nil
		}, guid)
		if err != nil {
			return nil, err
		}
	}
	var queued string
	var republished sql.NullString
	err = tx.row(ctx, "SELECT queued_at, republished_at FROM hook_redeliveries WHERE guid = $1 ORDER BY hook_id LIMIT 1", guid).Scan(&queued, &republished)
	if err == nil {
		h := &StoryHooks{RepublishedAt: parseTimePtr(republished)}
		h.QueuedAt, _ = time.Parse(time.RFC3339Nano, queued)
		st.Hooks = h
	} else if !errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("read hook_redeliveries: %w", err)
	}
	gaps, err := readGaps(ctx, tx, "WHERE guid = $1", guid)
	if err != nil {
		return nil, err
	}
	if len(gaps) == 1 {
		st.Gap = &gaps[0]
	}
	err = each("alert_outbox", "SELECT channel, sent_at, last_error FROM alert_outbox WHERE delivery_id IN ($1, $2, $3) ORDER BY id",
		func(rows *sql.Rows) error {
			var a StoryAlert
			var sent sql.NullString
			if err := rows.Scan(&a.Channel, &sent, &a.LastError); err != nil {
				return err
			}
			a.SentAt = parseTimePtr(sent)
			st.Alerts = append(st.Alerts, a)
			return nil
		}, guid, gapAlertID(guid), unrecoverableAlertID(guid))
	if err != nil {
		return nil, err
	}
	if len(st.Copies) == 0 && st.Hooks == nil && st.Gap == nil && len(st.GitHub) == 0 && len(st.Rejected) == 0 && len(st.Queued) == 0 {
		return nil, errorf(CodeNotFound, "%s: %s", ErrUnknownDelivery.Message, guid)
	}
	return st, nil
}

// StoryLine is one line of a delivery's story as people read it: a label
// and what it says. Head starts one hook's copy. The command prints the
// lines and the delivery page shows them, so that the two cannot tell
// different stories.
type StoryLine struct {
	Label, Text string
	Head        bool
}

// Lines tells the story, the way `deliveries show` prints it and the
// delivery page shows it: GitHub's attempts, then each hook's copy (when it
// was accepted and stored, through which broker, what each worker made of
// it, the typed rows it wrote), then what is the event's own: its
// redelivery, its gap, its messages waiting in queues and its alerts.
func (st *DeliveryStory) Lines() []StoryLine {
	var out []StoryLine
	add := func(label, format string, args ...any) {
		out = append(out, StoryLine{Label: label, Text: fmt.Sprintf(format, args...)})
	}
	when := func(t time.Time) string { return t.UTC().Format(time.RFC3339) }
	add("delivery", "%s", st.GUID)
	for _, a := range st.GitHub {
		line := fmt.Sprintf("%s %d %s", when(a.DeliveredAt), a.StatusCode, a.Status)
		if a.Redelivery {
			line += " (redelivery)"
		}
		add("github attempt", "%s", line)
	}
	for _, r := range st.Rejected {
		hook := "no hook"
		if r.Hook >= 0 {
			hook = fmt.Sprintf("hook %d", r.Hook)
		}
		add("rejected", "%s %d from %s, %s, %s: %s", when(r.At), r.Status, cmp.Or(r.SourceIP, "-"), hook, cmp.Or(r.Event, "no event"), r.Reason)
	}
	for _, q := range st.Queued {
		line := fmt.Sprintf("%s on node %s", when(q.QueuedAt), q.Node)
		switch {
		case q.PublishedAt != nil:
			line += fmt.Sprintf("; published %s to broker #%d", when(*q.PublishedAt), q.Broker)
		case q.Refused != "":
			line += "; refused by the broker for good: " + q.Refused
		default:
			line += "; waiting in the outbox for the broker"
		}
		add("queued", "%s", line)
	}
	for _, c := range st.Copies {
		head := fmt.Sprintf("hook %d", c.Hook)
		if c.Hook == 0 {
			head = "hook 0 (none recorded)"
		}
		if r := c.Received; r != nil && r.TargetType != "" {
			head += fmt.Sprintf(", sent to %s %d", r.TargetType, r.TargetID)
		}
		out = append(out, StoryLine{Label: "copy", Text: head, Head: true})
		if r := c.Received; r != nil {
			what := r.Event
			if r.Action != "" {
				what += "." + r.Action
			}
			add("event", "%s on %s by %s", what, cmp.Or(r.Repository, "-"), cmp.Or(r.Sender, "-"))
			forbidden := ""
			if r.Forbidden {
				forbidden = " (outside the allowed sources: github-forbidden)"
			}
			add("accepted", "%s from %s%s", when(r.ReceivedAt), cmp.Or(r.SourceIP, "-"), forbidden)
			if r.Broker != "" {
				// Stored as "host/vhost"; told as status tells a broker.
				host, vhost, _ := strings.Cut(r.Broker, "/")
				add("broker", "came through %s vhost %s", host, vhost)
			}
			add("stored", "%s", when(r.StoredAt))
			if r.TraceID != "" {
				add("trace", "%s", cmp.Or(r.TraceURL, r.TraceID))
			}
			// The raw row is the service worker's record (the cleanup
			// worker's for github-forbidden); the others keep their own.
			writer := "service"
			if r.Forbidden {
				writer = "cleanup"
			}
			add("worker "+writer, "stored the github row %s", when(r.StoredAt))
			if r.Duplicates > 0 && r.LastDuplicateAt != nil {
				times := "1 time"
				if r.Duplicates != 1 {
					times = fmt.Sprintf("%d times", r.Duplicates)
				}
				add("duplicate", "received again %s after it was stored, the last %s; the raw row kept as it was", times, when(*r.LastDuplicateAt))
			}
			if r.PrunedAt != nil {
				add("payload", "pruned %s (database.raw_retention); the row stays as the delivery's identity", when(*r.PrunedAt))
			} else if r.Unreadable != "" {
				add("payload", "unreadable: %s", r.Unreadable)
			} else {
				add("payload", "%d bytes", r.PayloadBytes)
			}
		} else {
			add("stored", "not in github")
		}
		for _, w := range c.Workers {
			outcome := "stored"
			if w.Outcome == "stale" {
				outcome = "stale: the typed row held a newer object and was kept"
			}
			add("worker "+w.Worker, "%s %s", outcome, when(w.At))
		}
		if r := c.Received; r != nil && !r.Forbidden && !slices.ContainsFunc(c.Workers, func(w StoryWorker) bool { return w.Worker == "database-service" }) {
			// The fanout gave the copy to both queues, or to github only
			// when the broker refused github-database's part of it (the
			// webhook was then answered 503, and GitHub's redelivery
			// brings it again).
			add("worker database-service", "%s", "not yet: its message waits in github-database, or the broker refused it there and a redelivery brings it")
		}
		for _, r := range c.Rows {
			add("typed row", "%s %s", r.Table, r.Key)
		}
	}
	if len(st.Copies) == 0 {
		add("stored", "not in github")
	}
	if h := st.Hooks; h != nil {
		line := "queued on github-hooks " + when(h.QueuedAt)
		if h.RepublishedAt != nil {
			line += ", republished " + when(*h.RepublishedAt)
		}
		add("redelivery", "%s", line)
	}
	if g := st.Gap; g != nil {
		state := "open"
		switch {
		case g.ResolvedAt != nil:
			state = "resolved " + when(*g.ResolvedAt)
		case g.UnrecoverableAt != nil:
			state = "unrecoverable: " + g.LastError
		case g.RedeliveredAt != nil:
			state = "open, redelivery asked " + when(*g.RedeliveredAt)
		}
		add("gap", "found %s, GitHub delivered it %s; %s", when(g.FoundAt), when(g.DeliveredAt), state)
	}
	for _, e := range st.Errors {
		add("in "+e.Queue, "%s on broker #%d, hook %d: %s (attempts %s)", e.Queue, e.Broker, e.Hook, e.Reason, cmp.Or(e.Attempts, "-"))
	}
	for _, a := range st.Alerts {
		state := "waiting"
		if a.SentAt != nil {
			state = "sent " + when(*a.SentAt)
		} else if a.LastError != "" {
			state = "not sent yet: " + a.LastError
		}
		add("alert "+a.Channel, "%s", state)
	}
	return out
}
