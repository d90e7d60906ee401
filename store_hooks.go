package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// HookQueued remembers that a failed delivery of hook's ledger (0: the
// App's) was queued on github-hooks.
func (tx *Tx) HookQueued(ctx context.Context, hook int64, guid string, githubID int64, event string) error {
	_, err := tx.write(ctx, atOnce, `INSERT INTO hook_redeliveries (hook_id, guid, delivery_id, event, queued_at)
		VALUES ($1, $2, $3, $4, $5) ON CONFLICT (hook_id, guid) DO NOTHING`, hook, guid, githubID, event, formatTime(time.Now()))
	if err != nil {
		return fmt.Errorf("write hook_redeliveries: %w", err)
	}
	return nil
}

// hookRepublished records, inside tx, that a queued delivery was published
// again.
func (tx *Tx) hookRepublished(ctx context.Context, hook int64, guid string) error {
	_, err := tx.write(ctx, atOnce, `UPDATE hook_redeliveries SET republished_at = $1 WHERE hook_id = $2 AND guid = $3`,
		formatTime(time.Now()), hook, guid)
	if err != nil {
		return fmt.Errorf("write hook_redeliveries: %w", err)
	}
	return nil
}

// appCopy selects the github rows that are the own copy of their event of
// the App whose id is the parameter param, as Event.AppCopy tells it: the
// copy its hook's deliveries, which the ledger reads, speak of. Another
// hook's copy of the same event (a repository webhook's) says nothing of
// the App's delivery.
func appCopy(param string) string {
	return "((target_type = 'integration' AND target_id = " + param + ") OR (hook_id = 0 AND target_type = ''))"
}

// hookCopy selects the github rows that are hook's copy of their event,
// the parameter param: a repository's or organization's webhook's.
func hookCopy(param string) string { return "hook_id = " + param }

// LedgerLookup reads, for each GUID of a hook's deliveries, whether that
// hook's copy is stored in github (appID's copy for the App's own hook,
// hook 0) and whether it was queued on github-hooks, a few hundred GUIDs
// per query.
func (s *Store) LedgerLookup(ctx context.Context, hook, appID int64, guids []string) (stored, queued map[string]bool, err error) {
	copyOf, key := hookCopy("?"), hook
	if hook == 0 {
		copyOf, key = appCopy("?"), appID
	}
	stored, queued = map[string]bool{}, map[string]bool{}
	for chunk := range slices.Chunk(guids, 500) {
		args := make([]any, len(chunk))
		for i, g := range chunk {
			args[i] = g
		}
		in := "(?" + strings.Repeat(", ?", len(chunk)-1) + ")"
		if err := s.collect(ctx, numberParams("SELECT delivery_id FROM github WHERE delivery_id IN "+in+" AND "+copyOf),
			append(slices.Clip(args), key), stored); err != nil {
			return nil, nil, fmt.Errorf("read the delivery ledger: %w", err)
		}
		if err := s.collect(ctx, numberParams("SELECT guid FROM hook_redeliveries WHERE guid IN "+in+" AND hook_id = ?"),
			append(slices.Clip(args), hook), queued); err != nil {
			return nil, nil, fmt.Errorf("read the delivery ledger: %w", err)
		}
	}
	return stored, queued, nil
}

func (s *Store) collect(ctx context.Context, query string, args []any, into map[string]bool) error {
	rows, err := s.pool().rows(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var g string
		if err := rows.Scan(&g); err != nil {
			return err
		}
		into[g] = true
	}
	return rows.Err()
}

// deliveryGap is one delivery_gaps row.
type deliveryGap struct {
	Hook          int64      `json:"hook"` // the hook whose ledger found it: 0 for the App's
	GUID          string     `json:"guid"`
	DeliveryID    int64      `json:"delivery_id"` // GitHub's id of the latest attempt
	Event         string     `json:"event"`
	DeliveredAt   time.Time  `json:"delivered_at"`
	FoundAt       time.Time  `json:"found_at"`
	RedeliveredAt *time.Time `json:"redelivered_at,omitempty"`
	ResolvedAt    *time.Time `json:"resolved_at,omitempty"`
	// Refusals counts the redeliveries GitHub refused for good; at
	// maxRefusals, or at once for a delivery no message may carry, the gap
	// is unrecoverable: never asked for again. LastError says why.
	Refusals        int        `json:"refusals,omitempty"`
	UnrecoverableAt *time.Time `json:"unrecoverable_at,omitempty"`
	LastError       string     `json:"last_error,omitempty"`
}

// unrecoverableAlertID is the alert_outbox delivery_id of the alert that a
// gap was given up on. An event's gap is alerted once, whichever hook's
// ledger found it first (the alert names that one's).
func unrecoverableAlertID(guid string) string { return "unrecoverable:" + guid }

// gapAlertID is the alert_outbox delivery_id of a gap's alert: apart from the
// alerts of the Event itself, which may come once it is stored.
func gapAlertID(guid string) string { return "gap:" + guid }

// RecordGap records a gap and queues its alert on each of channels, in tx.
// It reports false, changing nothing, when the gap is known.
func (tx *Tx) RecordGap(ctx context.Context, g deliveryGap, channels []string) (recorded bool, err error) {
	var unrecoverable any
	if g.UnrecoverableAt != nil {
		unrecoverable = formatTime(*g.UnrecoverableAt)
	}
	res, err := tx.write(ctx, atOnce, `INSERT INTO delivery_gaps (hook_id, guid, delivery_id, event, delivered_at, found_at, unrecoverable_at, last_error)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (hook_id, guid) DO NOTHING`,
		g.Hook, g.GUID, g.DeliveryID, g.Event, formatTime(g.DeliveredAt), formatTime(g.FoundAt), unrecoverable, g.LastError)
	if err != nil {
		return false, fmt.Errorf("record gap: %w", err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return false, nil
	}
	tx.s.gapsOpen.Store(true)
	if g.UnrecoverableAt != nil {
		return true, tx.queueAlerts(ctx, unrecoverableAlertID(g.GUID), channels)
	}
	return true, tx.queueAlerts(ctx, gapAlertID(g.GUID), channels)
}

// GapRefused counts one refusal for good of a gap's redelivery, with its
// reason. At limit refusals the gap becomes unrecoverable and its alert is
// queued on each of channels, in the same transaction; gaveUp reports it.
func (tx *Tx) GapRefused(ctx context.Context, hook int64, guid, reason string, limit int, channels []string) (gaveUp bool, err error) {
	var refusals int
	err = tx.row(ctx, `UPDATE delivery_gaps SET refusals = refusals + 1, last_error = $1
		WHERE hook_id = $2 AND guid = $3 AND unrecoverable_at IS NULL RETURNING refusals`, reason, hook, guid).Scan(&refusals)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("count a refused redelivery: %w", err)
	}
	if refusals < limit {
		return false, nil
	}
	if _, err := tx.write(ctx, atOnce, "UPDATE delivery_gaps SET unrecoverable_at = $1 WHERE hook_id = $2 AND guid = $3",
		formatTime(time.Now()), hook, guid); err != nil {
		return false, fmt.Errorf("give up a gap: %w", err)
	}
	return true, tx.queueAlerts(ctx, unrecoverableAlertID(guid), channels)
}

// GapsToRedeliver lists at most limit open gaps of hook's ledger that
// GitHub was not asked to redeliver yet and that are not given up on,
// oldest first.
func (s *Store) GapsToRedeliver(ctx context.Context, hook int64, limit int) ([]deliveryGap, error) {
	return s.gaps(ctx, `WHERE hook_id = $1 AND resolved_at IS NULL AND redelivered_at IS NULL AND unrecoverable_at IS NULL
		ORDER BY delivered_at, guid LIMIT $2`, hook, limit)
}

// GapRedelivered records that GitHub was asked to deliver hook's gap again.
func (tx *Tx) GapRedelivered(ctx context.Context, hook int64, guid string, at time.Time) error {
	_, err := tx.write(ctx, atOnce, "UPDATE delivery_gaps SET redelivered_at = $1 WHERE hook_id = $2 AND guid = $3", formatTime(at), hook, guid)
	return err
}

// ResolveGap marks hook's gap of guid resolved, inside the transaction
// that stores that hook's copy of it (hook 0: the App's). Nothing is asked
// while no gap is open (gapsOpen), so storing pays for it only while there
// is one.
func (tx *Tx) ResolveGap(ctx context.Context, hook int64, guid string) error {
	if !tx.s.gapsOpen.Load() {
		return nil
	}
	_, err := tx.write(ctx, atOnce, "UPDATE delivery_gaps SET resolved_at = $1 WHERE hook_id = $2 AND guid = $3 AND resolved_at IS NULL",
		formatTime(time.Now()), hook, guid)
	if err != nil {
		return fmt.Errorf("resolve gap: %w", err)
	}
	return nil
}

// ResolveStoredGaps resolves, in tx, every open gap of hook's ledger whose
// GUID that hook's copy is stored of (App appID's for hook 0), and
// refreshes whether any gap is still open. It returns how many it
// resolved.
func (tx *Tx) ResolveStoredGaps(ctx context.Context, hook, appID int64) (int64, error) {
	copyOf, key := hookCopy("$3"), hook
	if hook == 0 {
		copyOf, key = appCopy("$3"), appID
	}
	res, err := tx.write(ctx, atOnce, `UPDATE delivery_gaps SET resolved_at = $1 WHERE resolved_at IS NULL AND hook_id = $2
		AND EXISTS (SELECT 1 FROM github WHERE delivery_id = delivery_gaps.guid AND `+copyOf+`)`, formatTime(time.Now()), hook, key)
	if err != nil {
		return 0, fmt.Errorf("resolve stored gaps: %w", err)
	}
	n, _ := res.RowsAffected()
	var open int
	if err := tx.row(ctx, "SELECT count(*) FROM delivery_gaps WHERE resolved_at IS NULL").Scan(&open); err != nil {
		return 0, err
	}
	tx.s.gapsOpen.Store(open > 0)
	return n, nil
}

// NoteOpenGaps reads again whether any gap is open: another node (the hooks
// job's) may have recorded one, which storing its App copy here resolves.
func (s *Store) NoteOpenGaps(ctx context.Context) error {
	n, err := countOpenGaps(ctx, s.pool())
	if err != nil {
		return err
	}
	s.gapsOpen.Store(n > 0)
	return nil
}

// MayHaveOpenGaps reports whether delivery_gaps may hold an open gap: when
// it does not, resolving stored gaps has nothing to do, and no write lock
// need be taken for it.
func (s *Store) MayHaveOpenGaps() bool { return s.gapsOpen.Load() }

// OpenGaps lists at most limit of the gaps not resolved yet, the newest
// first, and counts them all: a database with a hundred thousand gaps must
// not make a page or an answer of their size.
func (s *Store) OpenGaps(ctx context.Context, limit int) (gaps []deliveryGap, total int, err error) {
	return openGaps(ctx, s.pool(), limit)
}

// openGaps is OpenGaps through q.
func openGaps(ctx context.Context, q dbReader, limit int) (gaps []deliveryGap, total int, err error) {
	if total, err = countOpenGaps(ctx, q); err != nil || total == 0 {
		return []deliveryGap{}, total, err
	}
	gaps, err = readGaps(ctx, q, "WHERE resolved_at IS NULL ORDER BY delivered_at DESC, guid LIMIT $1", limit)
	return gaps, total, err
}

// gaps reads the delivery_gaps rows the clause selects.
func (s *Store) gaps(ctx context.Context, clause string, args ...any) ([]deliveryGap, error) {
	return readGaps(ctx, s.pool(), clause, args...)
}

// readGaps reads the delivery_gaps rows the clause selects, through q.
func readGaps(ctx context.Context, q dbReader, clause string, args ...any) ([]deliveryGap, error) {
	rows, err := q.rows(ctx, `SELECT hook_id, guid, delivery_id, event, delivered_at, found_at, redelivered_at,
		refusals, unrecoverable_at, last_error, resolved_at FROM delivery_gaps `+clause, args...)
	if err != nil {
		return nil, fmt.Errorf("read gaps: %w", err)
	}
	defer rows.Close()
	out := []deliveryGap{}
	for rows.Next() {
		var g deliveryGap
		var delivered, found string
		var redelivered, unrecoverable, resolved sql.NullString
		if err := rows.Scan(&g.Hook, &g.GUID, &g.DeliveryID, &g.Event, &delivered, &found, &redelivered,
			&g.Refusals, &unrecoverable, &g.LastError, &resolved); err != nil {
			return nil, fmt.Errorf("read gaps: %w", err)
		}
		g.DeliveredAt, _ = time.Parse(time.RFC3339Nano, delivered)
		g.FoundAt, _ = time.Parse(time.RFC3339Nano, found)
		g.RedeliveredAt = parseTimePtr(redelivered)
		g.UnrecoverableAt = parseTimePtr(unrecoverable)
		g.ResolvedAt = parseTimePtr(resolved)
		out = append(out, g)
	}
	return out, rows.Err()
}

// parseTimePtr reads a nullable time column.
func parseTimePtr(s sql.NullString) *time.Time {
	if !s.Valid {
		return nil
	}
	t, _ := time.Parse(time.RFC3339Nano, s.String)
	return &t
}

// OpenGapsByHook counts the open gaps of each hook's ledger (0: the
// App's).
func (s *Store) OpenGapsByHook(ctx context.Context) (map[int64]int, error) {
	rows, err := s.pool().rows(ctx, "SELECT hook_id, count(*) FROM delivery_gaps WHERE resolved_at IS NULL GROUP BY hook_id")
	if err != nil {
		return nil, fmt.Errorf("count open gaps: %w", err)
	}
	defer rows.Close()
	out := map[int64]int{}
	for rows.Next() {
		var hook int64
		var n int
		if err := rows.Scan(&hook, &n); err != nil {
			return nil, fmt.Errorf("count open gaps: %w", err)
		}
		out[hook] = n
	}
	return out, rows.Err()
}

// UnrecoverableGapCount counts the open gaps given up on.
func (s *Store) UnrecoverableGapCount(ctx context.Context) (int, error) {
	return countUnrecoverableGaps(ctx, s.pool())
}

// countUnrecoverableGaps is UnrecoverableGapCount through q.
func countUnrecoverableGaps(ctx context.Context, q dbReader) (int, error) {
	var n int
	if err := q.row(ctx, "SELECT count(*) FROM delivery_gaps WHERE resolved_at IS NULL AND unrecoverable_at IS NOT NULL").Scan(&n); err != nil {
		return 0, fmt.Errorf("count unrecoverable gaps: %w", err)
	}
	return n, nil
}

// OpenGapCount counts the open gaps, for the metric.
func (s *Store) OpenGapCount(ctx context.Context) (int, error) {
	return countOpenGaps(ctx, s.pool())
}

// countOpenGaps is OpenGapCount through q.
func countOpenGaps(ctx context.Context, q dbReader) (int, error) {
	var n int
	if err := q.row(ctx, "SELECT count(*) FROM delivery_gaps WHERE resolved_at IS NULL").Scan(&n); err != nil {
		return 0, fmt.Errorf("count open gaps: %w", err)
	}
	return n, nil
}

// GitHubAttempt is GitHub's id of a delivery's latest attempt, when a
// hook's ledger learnt it (a gap, or a failed delivery queued on
// github-hooks), that hook (0: the App's; the lowest when several hooks'
// ledgers did), and when switchyard last asked GitHub to redeliver it.
func (s *Store) GitHubAttempt(ctx context.Context, guid string) (hook, id int64, asked *time.Time, err error) {
	var redelivered sql.NullString
	err = s.pool().row(ctx, "SELECT hook_id, delivery_id, redelivered_at FROM delivery_gaps WHERE guid = $1 ORDER BY hook_id LIMIT 1",
		guid).Scan(&hook, &id, &redelivered)
	if err == nil {
		return hook, id, parseTimePtr(redelivered), nil
	}
	if !errors.Is(err, sql.ErrNoRows) {
		return 0, 0, nil, fmt.Errorf("read delivery_gaps: %w", err)
	}
	err = s.pool().row(ctx, "SELECT hook_id, delivery_id FROM hook_redeliveries WHERE guid = $1 ORDER BY hook_id LIMIT 1", guid).Scan(&hook, &id)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, 0, nil, nil
	}
	if err != nil {
		return 0, 0, nil, fmt.Errorf("read hook_redeliveries: %w", err)
	}
	return hook, id, nil, nil
}

// maxAttemptStatus bounds the status text kept of one of GitHub's
// attempts: it comes from GitHub's API, and is a few words.
const maxAttemptStatus = 200

// RecordAttempts keeps GitHub's attempts the poll listed (an attempt seen
// before is kept as it was), and forgets at most retentionBatch of those
// delivered before cutoff, GitHub's 72 hours ago, in tx.
func (tx *Tx) RecordAttempts(ctx context.Context, hook int64, attempts []hookDelivery, cutoff time.Time) error {
	for _, a := range attempts {
		status := a.Status
		if len(status) > maxAttemptStatus {
			status = strings.ToValidUTF8(status[:maxAttemptStatus], "")
		}
		if _, err := tx.write(ctx, atOnce, `INSERT INTO github_attempts (attempt_id, guid, delivered_at, status_code, status, redelivery, hook_id)
			VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (attempt_id) DO NOTHING`,
			a.ID, a.GUID, formatTime(a.DeliveredAt), a.StatusCode, status, a.Redelivery, hook); err != nil {
			return fmt.Errorf("record GitHub's attempts: %w", err)
		}
	}
	if _, err := tx.write(ctx, atOnce, `DELETE FROM github_attempts WHERE attempt_id IN
		(SELECT attempt_id FROM github_attempts WHERE delivered_at < $1 LIMIT $2)`, formatTime(cutoff), retentionBatch); err != nil {
		return fmt.Errorf("forget GitHub's old attempts: %w", err)
	}
	return nil
}
