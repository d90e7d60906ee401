package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"
)

// DeliveryStory is what the database knows of one delivery: GitHub's
// attempts, its raw row, what each worker made of it, the typed rows it
// wrote, its redelivery through github-hooks, its gap, and its alerts.
type DeliveryStory struct {
	GUID string `json:"guid"`
	// GitHub are GitHub's attempts, oldest first, as the hooks poll listed
	// them (with the GitHub App configured, for 72 hours).
	GitHub   []StoryAttempt `json:"github_attempts"`
	Received *StoryReceipt  `json:"received,omitempty"`
	Workers  []StoryWorker  `json:"workers"`
	Rows     []StoryRow     `json:"typed_rows"`
	Hooks    *StoryHooks    `json:"redelivered_through_hooks,omitempty"`
	Gap      *deliveryGap   `json:"gap,omitempty"`
	Alerts   []StoryAlert   `json:"alerts"`
	// Errors are its messages waiting in -error queues (`deliveries show`
	// looks; the store does not know them).
	Errors  []StoryError `json:"waiting_in_error_queues,omitempty"`
	Payload string       `json:"-"`
}

// StoryAttempt is one of GitHub's attempts at the delivery: when, and the
// answer GitHub recorded.
type StoryAttempt struct {
	ID          int64     `json:"id"`
	DeliveredAt time.Time `json:"delivered_at"`
	StatusCode  int       `json:"status_code"`
	Status      string    `json:"status"`
	Redelivery  bool      `json:"redelivery"`
}

// maxStoryAttempts bounds the attempts a story lists.
const maxStoryAttempts = 50

// StoryError is one message of the delivery in an -error queue.
type StoryError struct {
	Broker   int    `json:"broker"`
	Queue    string `json:"queue"`
	Reason   string `json:"reason"`
	Attempts string `json:"attempts,omitempty"`
}

// StoryReceipt is the delivery's raw github row, without the payload.
type StoryReceipt struct {
	Event      string `json:"event"`
	Action     string `json:"action,omitempty"`
	Repository string `json:"repository,omitempty"`
	Sender     string `json:"sender,omitempty"`
	SourceIP   string `json:"source_ip,omitempty"`
	Forbidden  bool   `json:"forbidden"`
	HookID     int64  `json:"hook_id,omitempty"`
	TargetType string `json:"target_type,omitempty"`
	TargetID   int64  `json:"target_id,omitempty"`
	// Broker is the broker ("host/vhost") it came through to the worker
	// that stored it.
	Broker       string     `json:"broker,omitempty"`
	ReceivedAt   time.Time  `json:"received_at"`
	StoredAt     time.Time  `json:"stored_at"`
	PayloadBytes int        `json:"payload_bytes"`
	PrunedAt     *time.Time `json:"payload_pruned_at,omitempty"`
	// Duplicates is how often it came again after it was stored, the
	// last time at LastDuplicateAt.
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
var ErrUnknownDelivery = errors.New("no delivery with this GUID is known")

// storyTables are the typed tables that keep the delivery that wrote a
// row, and the column that names the row.
var storyTables = []struct{ table, key string }{
	{"github_releases", "release_id"}, {"github_release_workflow_runs", "run_id"}, {"github_branches", "ref"},
	{"github_issues", "node_id"}, {"github_pull_requests", "node_id"}, {"github_comments", "comment_id"},
	{"github_discussions", "node_id"}, {"github_check_runs", "check_run_id"}, {"github_pushes", "head_commit"},
	{"github_installations", "installation_id"}, {"github_repositories", "repository"},
}

// Story reads everything the database knows of delivery guid.
func (s *Store) Story(ctx context.Context, guid string) (*DeliveryStory, error) {
	st := &DeliveryStory{GUID: guid, GitHub: []StoryAttempt{}, Workers: []StoryWorker{}, Rows: []StoryRow{}, Alerts: []StoryAlert{}}
	var r StoryReceipt
	var received, stored string
	var targetID, hookID sql.NullInt64
	var pruned, lastDup sql.NullString
	err := s.r.QueryRowContext(ctx, `SELECT event, action, repository, sender, source_ip, forbidden, hook_id, target_type, target_id,
		received_at, processed_at, payload, payload_pruned_at, duplicates, last_duplicate_at, broker FROM github WHERE delivery_id = ?`, guid).
		Scan(&r.Event, &r.Action, &r.Repository, &r.Sender, &r.SourceIP, &r.Forbidden, &hookID, &r.TargetType, &targetID,
			&received, &stored, &st.Payload, &pruned, &r.Duplicates, &lastDup, &r.Broker)
	switch {
	case err == nil:
		r.HookID, r.TargetID, r.PayloadBytes, r.PrunedAt = hookID.Int64, targetID.Int64, len(st.Payload), parseTimePtr(pruned)
		r.LastDuplicateAt = parseTimePtr(lastDup)
		r.ReceivedAt, _ = time.Parse(time.RFC3339Nano, received)
		r.StoredAt, _ = time.Parse(time.RFC3339Nano, stored)
		st.Received = &r
	case !errors.Is(err, sql.ErrNoRows):
		return nil, fmt.Errorf("read github: %w", err)
	}
	attempts, err := s.r.QueryContext(ctx, `SELECT attempt_id, delivered_at, status_code, status, redelivery FROM github_attempts
		WHERE guid = ? ORDER BY delivered_at, attempt_id LIMIT ?`, guid, maxStoryAttempts)
	if err != nil {
		return nil, fmt.Errorf("read github_attempts: %w", err)
	}
	for attempts.Next() {
		var a StoryAttempt
		var at string
		if err := attempts.Scan(&a.ID, &at, &a.StatusCode, &a.Status, &a.Redelivery); err != nil {
			attempts.Close()
			return nil, err
		}
		a.DeliveredAt, _ = time.Parse(time.RFC3339Nano, at)
		st.GitHub = append(st.GitHub, a)
	}
	attempts.Close()
	rows, err := s.r.QueryContext(ctx, "SELECT worker, outcome, processed_at FROM worker_deliveries WHERE delivery_id = ? ORDER BY worker", guid)
	if err != nil {
		return nil, fmt.Errorf("read worker_deliveries: %w", err)
	}
	for rows.Next() {
		var w StoryWorker
		var at string
		if err := rows.Scan(&w.Worker, &w.Outcome, &at); err != nil {
			rows.Close()
			return nil, err
		}
		w.At, _ = time.Parse(time.RFC3339Nano, at)
		st.Workers = append(st.Workers, w)
	}
	rows.Close()
	for _, t := range storyTables {
		keys, err := s.r.QueryContext(ctx, "SELECT "+t.key+" FROM "+t.table+" WHERE delivery_id = ?", guid)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", t.table, err)
		}
		for keys.Next() {
			var k any
			if err := keys.Scan(&k); err != nil {
				keys.Close()
				return nil, err
			}
			st.Rows = append(st.Rows, StoryRow{Table: t.table, Key: fmt.Sprint(k)})
		}
		keys.Close()
	}
	var queued string
	var republished sql.NullString
	err = s.r.QueryRowContext(ctx, "SELECT queued_at, republished_at FROM hook_redeliveries WHERE guid = ?", guid).Scan(&queued, &republished)
	if err == nil {
		h := &StoryHooks{RepublishedAt: parseTimePtr(republished)}
		h.QueuedAt, _ = time.Parse(time.RFC3339Nano, queued)
		st.Hooks = h
	} else if !errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("read hook_redeliveries: %w", err)
	}
	gaps, err := s.gaps(ctx, "WHERE guid = ?", guid)
	if err != nil {
		return nil, err
	}
	if len(gaps) == 1 {
		st.Gap = &gaps[0]
	}
	alerts, err := s.r.QueryContext(ctx, "SELECT channel, sent_at, last_error FROM alert_outbox WHERE delivery_id IN (?, ?, ?) ORDER BY id",
		guid, gapAlertID(guid), unrecoverableAlertID(guid))
	if err != nil {
		return nil, fmt.Errorf("read alert_outbox: %w", err)
	}
	for alerts.Next() {
		var a StoryAlert
		var sent sql.NullString
		if err := alerts.Scan(&a.Channel, &sent, &a.LastError); err != nil {
			alerts.Close()
			return nil, err
		}
		a.SentAt = parseTimePtr(sent)
		st.Alerts = append(st.Alerts, a)
	}
	alerts.Close()
	if st.Received == nil && len(st.Workers) == 0 && st.Hooks == nil && st.Gap == nil && len(st.GitHub) == 0 {
		return nil, fmt.Errorf("%w: %s", ErrUnknownDelivery, guid)
	}
	return st, nil
}

// DeliveryFilter narrows a search of the stored deliveries; an empty field
// does not narrow.
type DeliveryFilter struct {
	GUIDPrefix, Event, Action, Repository, Sender string
	Outcome                                       string // "", "stored", "forbidden" or "stale"
	From, To                                      time.Time
	// After is the keyset cursor: the page starts after the row received
	// at AfterTime with id AfterID, in newest-first order.
	AfterTime time.Time
	AfterID   int64
}

// DeliveryRow is one stored delivery in a search's page.
type DeliveryRow struct {
	ID                                      int64
	GUID, Event, Action, Repository, Sender string
	Forbidden, Stale, Pruned                bool
	ReceivedAt                              time.Time
}

// SearchDeliveries returns the stored deliveries f selects, newest first,
// at most limit, from f's cursor on: a keyset page, which neither skips nor
// repeats a row while new ones arrive. more reports whether another page
// follows.
func (s *Store) SearchDeliveries(ctx context.Context, f DeliveryFilter, limit int) (rows []DeliveryRow, more bool, err error) {
	q, args := searchQuery(f, limit)
	res, err := s.r.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, false, fmt.Errorf("search deliveries: %w", err)
	}
	defer res.Close()
	for res.Next() {
		var r DeliveryRow
		var received string
		if err := res.Scan(&r.ID, &r.GUID, &r.Event, &r.Action, &r.Repository, &r.Sender, &r.Forbidden, &received,
			&r.Pruned, &r.Stale); err != nil {
			return nil, false, fmt.Errorf("search deliveries: %w", err)
		}
		r.ReceivedAt, _ = time.Parse(time.RFC3339Nano, received)
		rows = append(rows, r)
	}
	if len(rows) > limit {
		return rows[:limit], true, res.Err()
	}
	return rows, false, res.Err()
}

// searchQuery is the query of SearchDeliveries: at most limit+1 rows, so
// that a next page shows. Each filter reads an index in the page's order
// (TestSearchReadsIndexes): a page costs its rows, not the table's.
func searchQuery(f DeliveryFilter, limit int) (string, []any) {
	where := []string{"1 = 1"}
	var args []any
	add := func(clause string, a ...any) { where = append(where, clause); args = append(args, a...) }
	if f.GUIDPrefix != "" {
		// A range, not LIKE: it reads the unique index.
		add("g.delivery_id >= ? AND g.delivery_id < ?", f.GUIDPrefix, f.GUIDPrefix+"\uffff")
	}
	for col, v := range map[string]string{"event": f.Event, "action": f.Action, "repository": f.Repository, "sender": f.Sender} {
		if v != "" {
			add("g."+col+" = ?", v)
		}
	}
	switch f.Outcome {
	case "forbidden":
		add("g.forbidden = 1")
	case "stored":
		add("g.forbidden = 0")
	case "stale":
		add("g.delivery_id IN (SELECT delivery_id FROM worker_deliveries WHERE outcome = 'stale')")
	}
	if !f.From.IsZero() {
		add("g.received_at >= ?", formatTime(f.From))
	}
	if !f.To.IsZero() {
		add("g.received_at < ?", formatTime(f.To))
	}
	if !f.AfterTime.IsZero() {
		t := formatTime(f.AfterTime)
		add("(g.received_at < ? OR (g.received_at = ? AND g.id < ?))", t, t, f.AfterID)
	}
	args = append(args, limit+1)
	return `SELECT g.id, g.delivery_id, g.event, g.action, g.repository, g.sender, g.forbidden, g.received_at,
		g.payload_pruned_at IS NOT NULL,
		EXISTS (SELECT 1 FROM worker_deliveries w WHERE w.worker = 'database-service' AND w.delivery_id = g.delivery_id AND w.outcome = 'stale')
		FROM github g WHERE ` + strings.Join(where, " AND ") + ` ORDER BY g.received_at DESC, g.id DESC LIMIT ?`, args
}
