package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"
)

// GitHub keeps hook deliveries for 3 days; older ones cannot be fetched.
const deliveryRetention = 72 * time.Hour

// checkpointOverlap re-reads a little before the last checkpoint: a delivery
// GitHub records late must not fall between two polls.
const checkpointOverlap = 2 * time.Minute

// Hooks is the hooks worker's work: keep the delivery ledger
// against GitHub's record of its deliveries, queue each delivery that never
// got a 2xx once on github-hooks, and republish what the queue asks for.
type Hooks struct {
	app     *GitHubApp
	store   *Store
	brokers *Brokers
	queues  *Queues
	alerter *Alerter
	timeout time.Duration
	// grace is github.reconcile_grace; redeliver is github.redeliver_gaps.
	grace     time.Duration
	redeliver bool
	log       *slog.Logger
}

const keyHooksCheckpoint = "hooks.checkpoint"

// hookMessage is the body of a github-hooks message.
type hookMessage struct {
	DeliveryID int64  `json:"delivery_id"`
	GUID       string `json:"guid"`
}

// What became of one delivery GitHub made.
const (
	ledgerStored      = "stored"      // in github
	ledgerInFlight    = "in flight"   // a 2xx attempt younger than the grace: on its way through the retry cycle
	ledgerRedelivered = "redelivered" // no 2xx attempt: fetched and republished through github-hooks
	ledgerGap         = "gap"         // a 2xx attempt older than the grace, and not stored
)

// ledgerEntry is one GUID of GitHub's deliveries, its attempts folded.
type ledgerEntry struct {
	GUID    string
	Event   string
	Latest  hookDelivery // the latest attempt: what a fetch or a redelivery takes
	FirstOK time.Time    // the first 2xx attempt; zero when there is none
	Outcome string
}

// foldAttempts groups GitHub's attempts by GUID, in the order GitHub listed
// the GUIDs (newest first).
func foldAttempts(deliveries []hookDelivery) []*ledgerEntry {
	byGUID := map[string]*ledgerEntry{}
	var out []*ledgerEntry
	for _, d := range deliveries {
		if d.GUID == "" {
			continue
		}
		e := byGUID[d.GUID]
		if e == nil {
			e = &ledgerEntry{GUID: d.GUID, Event: d.Event, Latest: d}
			byGUID[d.GUID] = e
			out = append(out, e)
		}
		if d.StatusCode >= 200 && d.StatusCode < 300 && (e.FirstOK.IsZero() || d.DeliveredAt.Before(e.FirstOK)) {
			e.FirstOK = d.DeliveredAt
		}
		if d.DeliveredAt.After(e.Latest.DeliveredAt) {
			e.Latest = d
		}
	}
	return out
}

// classify sets each entry's outcome from what is stored, as of now.
func classify(entries []*ledgerEntry, stored map[string]bool, now time.Time, grace time.Duration) {
	for _, e := range entries {
		switch {
		case stored[e.GUID]:
			e.Outcome = ledgerStored
		case e.FirstOK.IsZero():
			e.Outcome = ledgerRedelivered
		case now.Sub(e.FirstOK) < grace:
			e.Outcome = ledgerInFlight
		default:
			e.Outcome = ledgerGap
		}
	}
}

// ledger lists GitHub's deliveries since since and classifies them.
func ledger(ctx context.Context, app *GitHubApp, store *Store, since, now time.Time, grace time.Duration) (entries []*ledgerEntry, queued map[string]bool, err error) {
	deliveries, err := app.ListDeliveries(ctx, since)
	if err != nil {
		return nil, nil, fmt.Errorf("list hook deliveries: %w", err)
	}
	entries = foldAttempts(deliveries)
	guids := make([]string, len(entries))
	for i, e := range entries {
		guids[i] = e.GUID
	}
	stored, queued, err := store.LedgerLookup(ctx, guids)
	if err != nil {
		return nil, nil, err
	}
	classify(entries, stored, now, grace)
	return entries, queued, nil
}

// Poll pages every delivery since the checkpoint (never more than GitHub's 3
// days) and accounts for each GUID: one with no 2xx attempt, neither stored
// nor queued already, is queued on github-hooks; a gap is recorded, alerted
// once and, with redeliver on, redelivered by GitHub; every open gap whose
// GUID is stored now is resolved. The checkpoint moves to now, but never past
// a delivery still in flight: later polls look at it again until it is stored
// or a gap. It moves only after a poll that did all it found.
func (h *Hooks) Poll(ctx context.Context) (queued int, err error) {
	now := time.Now().UTC()
	since := now.Add(-deliveryRetention)
	cp, err := h.store.Setting(ctx, keyHooksCheckpoint)
	if err != nil {
		return 0, err
	}
	if t, err := time.Parse(time.RFC3339Nano, cp); err == nil && t.Add(-checkpointOverlap).After(since) {
		since = t.Add(-checkpointOverlap)
	}
	entries, known, err := ledger(ctx, h.app, h.store, since, now, h.grace)
	if err != nil {
		return 0, err
	}
	checkpoint := now
	for _, e := range entries {
		switch e.Outcome {
		case ledgerRedelivered:
			if known[e.GUID] {
				continue
			}
			if err := h.queue(ctx, e.Latest); err != nil {
				return queued, err
			}
			queued++
		case ledgerInFlight:
			if e.FirstOK.Before(checkpoint) {
				checkpoint = e.FirstOK
			}
		case ledgerGap:
			if err := h.gap(ctx, e, now); err != nil {
				return queued, err
			}
		}
	}
	if err := h.redeliverGaps(ctx); err != nil {
		return queued, err
	}
	if n, err := h.store.ResolveStoredGaps(ctx); err != nil {
		return queued, err
	} else if n > 0 {
		h.log.Info("delivery gaps resolved: stored now", "gaps", n)
	}
	if err := h.store.SetSetting(ctx, keyHooksCheckpoint, formatTime(checkpoint)); err != nil {
		return queued, err
	}
	return queued, nil
}

// gap records a gap the first time a poll finds it, with its alert.
func (h *Hooks) gap(ctx context.Context, e *ledgerEntry, now time.Time) error {
	g := deliveryGap{GUID: e.GUID, DeliveryID: e.Latest.ID, Event: e.Event, DeliveredAt: e.FirstOK, FoundAt: now}
	recorded, err := h.store.RecordGap(ctx, g, h.alerter.Channels(&Event{Name: "gap", Action: e.Event, DeliveryID: e.GUID}))
	if err != nil {
		return err
	}
	if recorded {
		h.log.Warn("delivery gap: GitHub delivered it with a 2xx answer, but it is not stored",
			"delivery_id", e.GUID, "event", e.Event, "delivered_at", e.FirstOK.Format(time.RFC3339),
			"github_delivery", e.Latest.ID, "redeliver", h.redeliver)
	}
	return nil
}

// redeliverGaps asks GitHub to deliver each open gap not asked for yet once
// more. A refusal is logged and tried again at the next poll.
func (h *Hooks) redeliverGaps(ctx context.Context) error {
	if !h.redeliver {
		return nil
	}
	gaps, err := h.store.OpenGaps(ctx)
	if err != nil {
		return err
	}
	for _, g := range gaps {
		if g.RedeliveredAt != nil {
			continue
		}
		if err := h.app.Redeliver(ctx, g.DeliveryID); err != nil {
			h.log.Warn("GitHub did not take the redelivery of a gap, the next poll asks again",
				"delivery_id", g.GUID, "github_delivery", g.DeliveryID, "error", err)
			continue
		}
		h.log.Info("asked GitHub to redeliver a gap", "delivery_id", g.GUID, "github_delivery", g.DeliveryID)
		if err := h.store.GapRedelivered(ctx, g.GUID, time.Now()); err != nil {
			return err
		}
	}
	return nil
}

// queue publishes one github-hooks message, then remembers it.
func (h *Hooks) queue(ctx context.Context, d hookDelivery) error {
	body, _ := json.Marshal(hookMessage{DeliveryID: d.ID, GUID: d.GUID})
	hdr := http.Header{}
	hdr.Set(hdrDelivery, d.GUID)
	hdr.Set(hdrEvent, d.Event)
	msg := newPublishing(hdr, body, "", time.Now())
	b, err := h.brokers.Get(h.brokers.Cached().PublishTarget())
	if err != nil {
		return err
	}
	pctx, cancel := context.WithTimeout(ctx, h.timeout)
	defer cancel()
	if err := h.queues.Publish(pctx, b, "", queueHooks, msg); err != nil {
		return fmt.Errorf("queue redelivery of %s: %w", d.GUID, err)
	}
	h.log.Info("queued a failed delivery for redelivery", "delivery_id", d.GUID, "event", d.Event, "github_delivery", d.ID)
	return h.store.HookQueued(ctx, d.GUID, d.ID, d.Event)
}

// Handle is the github-hooks consumer: fetch the original request of the
// delivery and republish it through github-exchange, so that both the raw log
// and the typed tables get the Event. It talks to GitHub and the broker, so
// its worker never batches: it is never handed a transaction, and opens its
// own once the network is done with.
func (h *Hooks) Handle(ctx context.Context, _ *Tx, ev *Event) error {
	var m hookMessage
	if err := json.Unmarshal(ev.Payload, &m); err != nil || m.DeliveryID == 0 {
		return permanent("github-hooks message without delivery_id")
	}
	if done, err := h.store.Finished(ctx, "hooks", ev.DeliveryID); err != nil || done {
		return cmp.Or(err, ErrDuplicate)
	}
	d, err := h.app.Delivery(ctx, m.DeliveryID)
	var se *githubStatusError
	if errors.As(err, &se) && (se.Status == http.StatusNotFound || se.Status == http.StatusGone) {
		return permanent("GitHub no longer has delivery %d (%d): older than 3 days", m.DeliveryID, se.Status)
	}
	if err != nil {
		return err
	}
	hdr := http.Header{}
	for k, v := range d.Request.Headers {
		hdr.Set(k, v)
	}
	if hdr.Get(hdrDelivery) == "" {
		hdr.Set(hdrDelivery, d.GUID)
	}
	if hdr.Get(hdrEvent) == "" {
		hdr.Set(hdrEvent, d.Event)
	}
	// The headers become the message's, as a webhook's do: checked first,
	// so that nothing in them can close the shared connection.
	if err := checkHeaders(hdr); err != nil {
		return permanent("delivery %d: %v", m.DeliveryID, err)
	}
	payload := unwrapPayload(d.Request.Payload)
	if _, _, err := decodePayload(payload, hdr.Get(hdrEvent)); err != nil {
		return permanent("delivery %d: %v", m.DeliveryID, err)
	}
	b, err := h.brokers.Get(h.brokers.Cached().PublishTarget())
	if err != nil {
		return err
	}
	pctx, cancel := context.WithTimeout(ctx, h.timeout)
	defer cancel()
	msg := newPublishing(hdr, payload, "", time.Now())
	if err := h.queues.Publish(pctx, b, exchangeName, "", msg); err != nil {
		return fmt.Errorf("republish %s: %w", d.GUID, err)
	}
	_, err = h.store.MarkDelivery(ctx, nil, "hooks", ev.DeliveryID, func(tx *Tx) (string, error) {
		return "", tx.hookRepublished(ctx, ev.DeliveryID)
	})
	return err
}
