package main

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// Finding deliveries: the stored ones and the refused ones, newest first,
// a keyset page at a time, narrowed by a DeliveryFilter.

// DeliveryFilter narrows a search of the stored deliveries; an empty field
// does not narrow.
type DeliveryFilter struct {
	GUIDPrefix, Event, Action, Repository, Sender string
	// Outcome is "", "stored", "forbidden" or "stale"; or "rejected": the
	// refused webhooks (rejected_webhooks), which Action, Repository and
	// Sender cannot narrow (their bodies are not kept).
	Outcome string
	// Hook, when set, narrows to the copies sent to that hook.
	Hook     *int64
	From, To time.Time
	// After is the keyset cursor: the page starts after the row received
	// at AfterTime with id AfterID, in newest-first order.
	AfterTime time.Time
	AfterID   int64
}

// DeliveryRow is one delivery in a search's page: a stored copy, or a
// refused webhook.
type DeliveryRow struct {
	ID         int64     `json:"-"`
	ReceivedAt time.Time `json:"received_at"`
	GUID       string    `json:"delivery_id"`
	// Hook is the hook the copy was sent to, 0 when none recorded (-1 for
	// a refused webhook without one).
	Hook       HookID `json:"hook_id"`
	TargetType string `json:"target_type,omitempty"`
	Event      string `json:"event"`
	Action     string `json:"action,omitempty"`
	Repository string `json:"repository,omitempty"`
	Sender     string `json:"sender,omitempty"`
	// Outcome is stored, forbidden, stale or rejected.
	Outcome string `json:"outcome"`
	Pruned  bool   `json:"payload_pruned,omitempty"`
	// A refused webhook's answer, and where it came from.
	Status   int    `json:"status,omitempty"`
	Reason   string `json:"reason,omitempty"`
	SourceIP string `json:"source_ip,omitempty"`
}

// SearchDeliveries returns the stored deliveries f selects, newest first,
// at most limit, from f's cursor on: a keyset page, which neither skips nor
// repeats a row while new ones arrive. more reports whether another page
// follows.
func (s *Store) SearchDeliveries(ctx context.Context, f DeliveryFilter, limit int) (rows []DeliveryRow, more bool, err error) {
	q, args := searchQuery(f, limit)
	if f.Outcome == "rejected" {
		q, args = rejectedQuery(f, limit)
	}
	res, err := s.pool().rows(ctx, q, args...)
	if err != nil {
		return nil, false, fmt.Errorf("search deliveries: %w", err)
	}
	defer res.Close()
	for res.Next() {
		var r DeliveryRow
		if f.Outcome == "rejected" {
			rej, err := scanRejection(res, []any{&r.ID})
			if err != nil {
				return nil, false, err
			}
			r.ReceivedAt, r.GUID, r.Hook, r.Event, r.Outcome = rej.At, rej.GUID, rej.Hook, rej.Event, "rejected"
			r.Status, r.Reason, r.SourceIP = rej.Status, rej.Reason, rej.SourceIP
			rows = append(rows, r)
			continue
		}
		var received string
		var forbidden, stale bool
		if err := res.Scan(&r.ID, &r.GUID, &r.Hook, &r.TargetType, &r.Event, &r.Action, &r.Repository, &r.Sender, &forbidden, &received,
			&r.Pruned, &stale); err != nil {
			return nil, false, fmt.Errorf("search deliveries: %w", err)
		}
		r.ReceivedAt, _ = time.Parse(time.RFC3339Nano, received)
		r.Outcome = "stored"
		if forbidden {
			r.Outcome = "forbidden"
		} else if stale {
			r.Outcome = "stale"
		}
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
	var w searchWhere
	// A slice, not a map: the same filter is the same query text, which
	// the statement cache and the query plan test rely on.
	for _, c := range []struct{ col, v string }{{"event", f.Event}, {"action", f.Action}, {"repository", f.Repository}, {"sender", f.Sender}} {
		if c.v != "" {
			w.add("g."+c.col+" = ?", c.v)
		}
	}
	switch f.Outcome {
	case "forbidden":
		w.add("g.forbidden = 1")
	case "stored":
		w.add("g.forbidden = 0")
	case "stale":
		w.add("(g.delivery_id, g.hook_id) IN (SELECT delivery_id, hook_id FROM worker_deliveries WHERE outcome = 'stale')")
	}
	return w.query(f, "g", `SELECT g.id, g.delivery_id, g.hook_id, g.target_type, g.event, g.action, g.repository, g.sender, g.forbidden, g.received_at,
		g.payload_pruned_at IS NOT NULL,
		EXISTS (SELECT 1 FROM worker_deliveries w WHERE w.worker = 'database-service' AND w.delivery_id = g.delivery_id
			AND w.hook_id = g.hook_id AND w.outcome = 'stale')
		FROM github g`, limit)
}

// rejectedQuery is SearchDeliveries' query of the refused webhooks, in
// the same order and pages.
func rejectedQuery(f DeliveryFilter, limit int) (string, []any) {
	var w searchWhere
	if f.Event != "" {
		w.add("r.event = ?", f.Event)
	}
	return w.query(f, "r", `SELECT r.id, r.received_at, r.source_ip, r.event, r.delivery_id, r.hook_id, r.status, r.reason
		FROM rejected_webhooks r`, limit)
}

// searchWhere gathers a search's conditions, each with its arguments.
type searchWhere struct {
	clauses []string
	args    []any
}

func (w *searchWhere) add(clause string, args ...any) {
	w.clauses = append(w.clauses, clause)
	w.args = append(w.args, args...)
}

// query is sel (whose table is aliased a) narrowed by w's conditions and
// by those of f that both searches have (GUID prefix, hook, time range,
// cursor), newest first, at most limit+1 rows.
func (w *searchWhere) query(f DeliveryFilter, a, sel string, limit int) (string, []any) {
	if f.GUIDPrefix != "" {
		// A range, not LIKE: it reads the index.
		w.add(a+".delivery_id >= ? AND "+a+".delivery_id < ?", f.GUIDPrefix, f.GUIDPrefix+"\uffff")
	}
	if f.Hook != nil {
		w.add(a+".hook_id = ?", *f.Hook)
	}
	if !f.From.IsZero() {
		w.add(a+".received_at >= ?", formatTime(f.From))
	}
	if !f.To.IsZero() {
		w.add(a+".received_at < ?", formatTime(f.To))
	}
	if !f.AfterTime.IsZero() {
		t := formatTime(f.AfterTime)
		w.add("("+a+".received_at < ? OR ("+a+".received_at = ? AND "+a+".id < ?))", t, t, f.AfterID)
	}
	where := "1 = 1"
	if len(w.clauses) > 0 {
		where = strings.Join(w.clauses, " AND ")
	}
	return numberParams(sel + " WHERE " + where + " ORDER BY " + a + ".received_at DESC, " + a + ".id DESC LIMIT ?"), append(w.args, limit+1)
}
