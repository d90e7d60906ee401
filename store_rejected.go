package main

import (
	"cmp"
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Refused webhooks, kept: each webhook answered 4xx or 5xx, as its
// request claimed it (never its body or signature), in rejected_webhooks,
// the newest rejectionsKept of the last rejectionsKeptFor.

const (
	rejectionsKept    = 10000
	rejectionsKeptFor = 7 * 24 * time.Hour
	// maxRejectionReason bounds the reason kept.
	maxRejectionReason = 300
)

// Rejection is one refused webhook.
type Rejection struct {
	At       time.Time `json:"received_at"`
	SourceIP string    `json:"source_ip,omitempty"`
	Event    string    `json:"event,omitempty"`
	GUID     string    `json:"delivery_id,omitempty"`
	Hook     HookID    `json:"hook_id"` // -1: none, or malformed
	Status   int       `json:"status"`
	Reason   string    `json:"reason"`
}

// HookID is a hook's ID in an answer, -1 for none: null in JSON.
type HookID int64

func (h HookID) MarshalJSON() ([]byte, error) {
	if h < 0 {
		return []byte("null"), nil
	}
	return strconv.AppendInt(nil, int64(h), 10), nil
}

func (h *HookID) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*h = -1
		return nil
	}
	n, err := strconv.ParseInt(string(b), 10, 64)
	*h = HookID(n)
	return err
}

// RecordRejections writes rs in tx.
func (tx *Tx) RecordRejections(ctx context.Context, rs []Rejection) error {
	for _, r := range rs {
		reason := r.Reason
		if len(reason) > maxRejectionReason {
			reason = reason[:maxRejectionReason]
		}
		var hook any
		if r.Hook >= 0 {
			hook = r.Hook
		}
		if _, err := tx.write(ctx, atOnce, `INSERT INTO rejected_webhooks (received_at, source_ip, event, delivery_id, hook_id, status, reason)
			VALUES ($1, $2, $3, $4, $5, $6, $7)`, formatTime(r.At), r.SourceIP, r.Event, r.GUID, hook, r.Status, reason); err != nil {
			return fmt.Errorf("record refused webhooks: %w", err)
		}
	}
	return nil
}

// PruneRejections deletes, in tx, the refused webhooks older than
// rejectionsKeptFor before now and those past the newest rejectionsKept.
func (tx *Tx) PruneRejections(ctx context.Context, now time.Time) error {
	_, err := tx.write(ctx, atOnce, `DELETE FROM rejected_webhooks WHERE received_at < $1
		OR id <= (SELECT id FROM rejected_webhooks ORDER BY id DESC LIMIT 1 OFFSET $2)`,
		formatTime(now.Add(-rejectionsKeptFor)), rejectionsKept)
	if err != nil {
		return fmt.Errorf("prune refused webhooks: %w", err)
	}
	return nil
}

// maxStoryRejections bounds the refusals a story lists.
const maxStoryRejections = 50

// rejectionsOf are guid's refusals, oldest first, read in q.
func rejectionsOf(ctx context.Context, q dbReader, guid string) ([]Rejection, error) {
	rows, err := q.rows(ctx, `SELECT received_at, source_ip, event, delivery_id, hook_id, status, reason
		FROM rejected_webhooks WHERE delivery_id = $1 ORDER BY received_at, id LIMIT $2`, guid, maxStoryRejections)
	if err != nil {
		return nil, fmt.Errorf("read rejected_webhooks: %w", err)
	}
	defer rows.Close()
	var out []Rejection
	for rows.Next() {
		r, err := scanRejection(rows, nil)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

// scanRejection reads one row of rejected_webhooks's columns (received_at,
// source_ip, event, delivery_id, hook_id, status, reason), after extra.
func scanRejection(rows *sql.Rows, extra []any) (Rejection, error) {
	var r Rejection
	var at string
	var hook sql.NullInt64
	if err := rows.Scan(append(extra, &at, &r.SourceIP, &r.Event, &r.GUID, &hook, &r.Status, &r.Reason)...); err != nil {
		return r, fmt.Errorf("read rejected_webhooks: %w", err)
	}
	r.At, _ = time.Parse(time.RFC3339Nano, at)
	r.Hook = -1
	if hook.Valid {
		r.Hook = HookID(hook.Int64)
	}
	return r, nil
}

// ReasonCount is how many webhooks of the last hour were answered one way
// for one reason: refused with Status, or spooled (Status 202).
type ReasonCount struct {
	Status int    `json:"status"`
	Reason string `json:"reason"`
	Count  int    `json:"count"`
}

// reasonKind is the kind of a refusal's reason: its text up to the first
// colon, which names the kind without the delivery it was about.
func reasonKind(reason string) string {
	kind, _, _ := strings.Cut(reason, ":")
	return kind
}

// refusalsSince counts, read in q, the webhooks refused since since, by
// status and the kind of their reason, most first.
func refusalsSince(ctx context.Context, q dbReader, since time.Time) ([]ReasonCount, error) {
	rows, err := q.rows(ctx, `SELECT status, reason FROM rejected_webhooks WHERE received_at >= $1 ORDER BY id DESC LIMIT $2`,
		formatTime(since), rejectionsKept)
	if err != nil {
		return nil, fmt.Errorf("read rejected_webhooks: %w", err)
	}
	defer rows.Close()
	counts := map[ReasonCount]int{}
	for rows.Next() {
		var k ReasonCount
		if err := rows.Scan(&k.Status, &k.Reason); err != nil {
			return nil, fmt.Errorf("read rejected_webhooks: %w", err)
		}
		k.Reason = reasonKind(k.Reason)
		counts[k]++
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read rejected_webhooks: %w", err)
	}
	return sortedCounts(counts), nil
}

// sortedCounts are counts as a list, most first, then by status and reason.
func sortedCounts(counts map[ReasonCount]int) []ReasonCount {
	out := make([]ReasonCount, 0, len(counts))
	for k, n := range counts {
		k.Count = n
		out = append(out, k)
	}
	slices.SortFunc(out, func(a, b ReasonCount) int {
		return cmp.Or(cmp.Compare(b.Count, a.Count), cmp.Compare(a.Status, b.Status), strings.Compare(a.Reason, b.Reason))
	})
	return out
}
