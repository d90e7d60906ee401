package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// checkpointOverlap re-reads a little before the last checkpoint: a delivery
// GitHub records late must not fall between two polls.
const checkpointOverlap = 2 * time.Minute

// Hooks is the hooks worker's work: keep each hook's delivery ledger (the
// App's own hook's, and each repository's or organization's webhook's)
// against GitHub's record of its deliveries, queue each delivery that never
// got a 2xx once on github-hooks, and republish what the queue asks for.
type Hooks struct {
	ledgers []*HookLedger
	appID   int64 // github.app_id: 0 without the App
	store   *Store
	brokers *Brokers
	queues  *Queues
	alerter *Alerter
	// grace is github.reconcile_grace; window github.delivery_window;
	// redeliver is github.redeliver_gaps; maxPages is
	// github.max_pages_per_poll.
	grace     time.Duration
	window    time.Duration
	redeliver bool
	maxPages  int
	// pollTimeout bounds one poll; zero is ledgerTimeout.
	pollTimeout time.Duration
	tracer      Tracer // each github-hooks message's span
	log         *slog.Logger
}

// NewHooks is the hooks worker's work for cfg, over ledgers
// (NewHookLedgers); the messages it takes are spans of tp.
func NewHooks(cfg *Config, ledgers []*HookLedger, store *Store, brokers *Brokers, queues *Queues, alerter *Alerter,
	tp trace.TracerProvider, log *slog.Logger) *Hooks {
	return &Hooks{ledgers: ledgers, appID: cfg.GitHub.AppID, store: store, brokers: brokers, queues: queues, alerter: alerter,
		grace: cfg.GitHub.ReconcileGrace, window: cmp.Or(cfg.GitHub.DeliveryWindow, githubRedeliveryWindow),
		redeliver: cfg.GitHub.RedeliverGaps, maxPages: cfg.GitHub.MaxPagesPerPoll, tracer: NewTracer(tp), log: log}
}

// Ledgers are the hooks whose deliveries the worker keeps account of.
func (h *Hooks) Ledgers() []*HookLedger { return h.ledgers }

// ledgerOf is hook's ledger (0: the App's), nil when none is configured.
func (h *Hooks) ledgerOf(hook int64) *HookLedger {
	for _, l := range h.ledgers {
		if l.Hook() == hook {
			return l
		}
	}
	return nil
}

// keyHooksCheckpoint is the settings key of the App's hook's checkpoint;
// another hook's is checkpointKey's.
const keyHooksCheckpoint = "hooks.checkpoint"

// checkpointKey is the settings key of hook's ledger's checkpoint: where
// its next poll begins.
func checkpointKey(hook int64) string {
	if hook == 0 {
		return keyHooksCheckpoint
	}
	return fmt.Sprintf("%s.%d", keyHooksCheckpoint, hook)
}

// refusedKey is the settings key that holds, while GitHub refuses hook's
// ledger, since when and why ("TIME REASON"); empty while it answers.
func refusedKey(hook int64) string { return fmt.Sprintf("hooks.refused.%d", hook) }

// hookMessage is the body of a github-hooks message: a failed delivery of
// the ledger of Hook (0, or none from an older version: the App's).
type hookMessage struct {
	DeliveryID int64  `json:"delivery_id"`
	GUID       string `json:"guid"`
	Hook       int64  `json:"hook,omitempty"`
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
	// Attempts are every attempt listed, for the delivery's story.
	Attempts []hookDelivery
	Outcome  string
}

// attemptFold folds GitHub's attempts, page by page, into one entry per
// GUID, in the order GitHub listed the GUIDs (newest first). It holds a
// small entry per GUID, never GitHub's pages, and no more GUIDs than
// github.max_pages_per_poll pages list.
type attemptFold struct {
	byGUID  map[string]*ledgerEntry
	entries []*ledgerEntry
}

func newAttemptFold() *attemptFold { return &attemptFold{byGUID: map[string]*ledgerEntry{}} }

// add folds one page of attempts in.
func (b *attemptFold) add(page []hookDelivery) {
	for _, d := range page {
		if d.GUID == "" {
			continue
		}
		e := b.byGUID[d.GUID]
		if e == nil {
			e = &ledgerEntry{GUID: d.GUID, Event: d.Event, Latest: d}
			b.byGUID[d.GUID] = e
			b.entries = append(b.entries, e)
		}
		e.Attempts = append(e.Attempts, d)
		if d.StatusCode >= 200 && d.StatusCode < 300 && (e.FirstOK.IsZero() || d.DeliveredAt.Before(e.FirstOK)) {
			e.FirstOK = d.DeliveredAt
		}
		if d.DeliveredAt.After(e.Latest.DeliveredAt) {
			e.Latest = d
		}
	}
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

// ledgerTimeout bounds one read of GitHub's deliveries, a poll's or the
// deliveries command's: an API that answers slowly, or forever, must not
// hold the hooks worker.
const ledgerTimeout = 2 * time.Minute

// ledger lists l's deliveries since since, at most maxPages pages, and
// classifies them. complete reports whether the listing got back to since.
func ledger(ctx context.Context, l *HookLedger, store *Store, since, now time.Time, grace time.Duration, maxPages int) (
	entries []*ledgerEntry, queued map[string]bool, complete bool, err error) {
	fold := newAttemptFold()
	complete, err = l.EachDeliveryPage(ctx, since, maxPages, func(page []hookDelivery) error {
		fold.add(page)
		return nil
	})
	if err != nil {
		return nil, nil, false, fmt.Errorf("list hook deliveries: %w", err)
	}
	guids := make([]string, len(fold.entries))
	for i, e := range fold.entries {
		guids[i] = e.GUID
	}
	stored, queued, err := store.LedgerLookup(ctx, l.Hook(), l.appID, guids)
	if err != nil {
		return nil, nil, false, err
	}
	classify(fold.entries, stored, now, grace)
	return fold.entries, queued, complete, nil
}

// Poll polls each hook's ledger (pollLedger), one after another; a hook
// whose credential or ID GitHub refuses (401, 403, 404) is recorded as a
// problem of that hook, alerted once, and the other hooks go on. queued
// counts the failed deliveries queued; err joins the other hooks' errors.
func (h *Hooks) Poll(ctx context.Context, held Holding) (queued int, err error) {
	var errs []error
	for _, l := range h.ledgers {
		n, err := h.pollLedger(ctx, held, l)
		queued += n
		switch {
		case refusesCredential(err):
			errs = append(errs, fmt.Errorf("%s: %w", l, err)) // the worker's cycle shows it failing
			if err := h.ledgerRefused(ctx, held, l, err); err != nil {
				errs = append(errs, err)
			}
		case err != nil:
			errs = append(errs, fmt.Errorf("%s: %w", l, err))
		default:
			if err := h.ledgerAnswers(ctx, held, l); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return queued, errors.Join(errs...)
}

// ledgerRefused records, the first time, that GitHub refuses l's ledger,
// with its alert (rule event "ledger"); while it stays refused, nothing
// more.
func (h *Hooks) ledgerRefused(ctx context.Context, held Holding, l *HookLedger, why error) error {
	if was, err := h.store.Setting(ctx, refusedKey(l.Hook())); err != nil || was != "" {
		return err
	}
	now := time.Now().UTC()
	h.log.Error("delivery ledger: GitHub refuses this hook's; the other hooks go on", "hook", l.String(), "error", why)
	return held.WriteTx(ctx, h.store, func(tx *Tx) error {
		if err := tx.SetSetting(ctx, refusedKey(l.Hook()), formatTime(now)+" "+why.Error(), now); err != nil {
			return err
		}
		_, err := tx.QueueOwnAlert(ctx, ledgerAlertID(l, now, why), h.alerter.ChannelsFor(AlertIntent{Name: "ledger"}))
		return err
	})
}

// ledgerAnswers clears l's refusal once GitHub answers its ledger again.
func (h *Hooks) ledgerAnswers(ctx context.Context, held Holding, l *HookLedger) error {
	if was, err := h.store.Setting(ctx, refusedKey(l.Hook())); err != nil || was == "" {
		return err
	}
	h.log.Info("delivery ledger: GitHub answers this hook's again", "hook", l.String())
	return held.WriteTx(ctx, h.store, func(tx *Tx) error { return tx.SetSetting(ctx, refusedKey(l.Hook()), "", time.Now()) })
}

// ledgerAlertID names the alert of GitHub refusing l's ledger since since.
func ledgerAlertID(l *HookLedger, since time.Time, why error) string {
	return fmt.Sprintf("ledger:%s since %s because %s", l, since.Format(time.RFC3339), why)
}

// pollLedger pages every delivery of l since its checkpoint (never more
// than github.delivery_window, nor github.max_pages_per_poll pages, within
// ledgerTimeout) and accounts for each GUID: one with no 2xx attempt, neither stored nor queued
// already, is queued on github-hooks; a gap is recorded, alerted once and,
// with redeliver on, redelivered by GitHub at the pace
// github.redeliver_per_minute allows; every open gap whose GUID is stored
// now is resolved. A GUID or event from the API that no message may carry
// makes an unrecoverable gap instead. The checkpoint moves to now, but never
// past a delivery still in flight, nor when the listing stopped short: later
// polls look again. It moves only after a poll that did all it found.
func (h *Hooks) pollLedger(ctx context.Context, held Holding, l *HookLedger) (queued int, err error) {
	ctx, cancel := context.WithTimeout(ctx, cmp.Or(h.pollTimeout, ledgerTimeout))
	defer cancel()
	now := time.Now().UTC()
	since := now.Add(-h.window)
	cp, err := h.store.Setting(ctx, checkpointKey(l.Hook()))
	if err != nil {
		return 0, err
	}
	if t, err := time.Parse(time.RFC3339Nano, cp); err == nil && t.Add(-checkpointOverlap).After(since) {
		since = t.Add(-checkpointOverlap)
	}
	entries, known, complete, err := ledger(ctx, l, h.store, since, now, h.grace, cmp.Or(h.maxPages, 100))
	if err != nil {
		return 0, err
	}
	if err := h.recordAttempts(ctx, held, l, entries, now); err != nil {
		return 0, err
	}
	checkpoint := now
	if !complete {
		checkpoint = since.Add(checkpointOverlap)
	}
	for _, e := range entries {
		if e.Outcome == ledgerStored {
			continue
		}
		if reason := apiDeliveryProblem(e); reason != "" {
			if err := h.unrecoverable(ctx, held, l, e, now, reason); err != nil {
				return queued, err
			}
			continue
		}
		switch e.Outcome {
		case ledgerRedelivered:
			if known[e.GUID] {
				continue
			}
			if err := h.queue(ctx, held, l, e.Latest); err != nil {
				return queued, err
			}
			queued++
		case ledgerInFlight:
			if e.FirstOK.Before(checkpoint) {
				checkpoint = e.FirstOK
			}
		case ledgerGap:
			if err := h.gap(ctx, held, l, e, now); err != nil {
				return queued, err
			}
		}
	}
	if err := h.redeliverGaps(ctx, held, l); err != nil {
		return queued, err
	}
	if h.store.MayHaveOpenGaps() {
		var n int64
		if err := held.WriteTx(ctx, h.store, func(tx *Tx) (err error) { n, err = tx.ResolveStoredGaps(ctx, l.Hook(), h.appID); return err }); err != nil {
			return queued, err
		}
		if n > 0 {
			h.log.Info("delivery gaps resolved: stored now", "hook", l.String(), "gaps", n)
		}
	}
	err = held.WriteTx(ctx, h.store, func(tx *Tx) error {
		return tx.SetSetting(ctx, checkpointKey(l.Hook()), formatTime(checkpoint), time.Now())
	})
	return queued, err
}

// apiDeliveryProblem says why a delivery GitHub's API listed cannot become a
// message, "" when it can: its GUID and event become message headers, and
// are held to a webhook's rules (checkHeaders), so that nothing the API
// says can break an AMQP frame and the shared connection with it.
func apiDeliveryProblem(e *ledgerEntry) string {
	hdr := http.Header{}
	hdr.Set(hdrDelivery, e.GUID)
	hdr.Set(hdrEvent, e.Event)
	if err := checkHeaders(hdr); err != nil {
		return "GitHub's API listed a delivery no message may carry: " + err.Error()
	}
	return ""
}

// recordAttempts keeps GitHub's attempts of every entry a message could
// carry, for the deliveries' stories.
func (h *Hooks) recordAttempts(ctx context.Context, held Holding, l *HookLedger, entries []*ledgerEntry, now time.Time) error {
	var attempts []hookDelivery
	for _, e := range entries {
		if apiDeliveryProblem(e) == "" {
			attempts = append(attempts, e.Attempts...)
		}
	}
	return held.WriteTx(ctx, h.store, func(tx *Tx) error { return tx.RecordAttempts(ctx, l.Hook(), attempts, now.Add(-h.window)) })
}

// gap records a gap the first time a poll finds it, with its alert.
func (h *Hooks) gap(ctx context.Context, held Holding, l *HookLedger, e *ledgerEntry, now time.Time) error {
	g := deliveryGap{Hook: l.Hook(), GUID: e.GUID, DeliveryID: e.Latest.ID, Event: e.Event, DeliveredAt: e.FirstOK, FoundAt: now}
	recorded, err := h.recordGap(ctx, held, g, AlertIntent{Name: "gap", Action: e.Event})
	if err != nil {
		return err
	}
	if recorded {
		h.log.Warn("delivery gap: GitHub delivered it with a 2xx answer, but it is not stored",
			"hook", l.String(), "delivery_id", e.GUID, "event", e.Event, "delivered_at", e.FirstOK.Format(time.RFC3339),
			"github_delivery", e.Latest.ID, "redeliver", h.redeliver)
	}
	return nil
}

// unrecoverable records e as a gap given up on at once, with its alert,
// the first time a poll finds it: reason says why.
func (h *Hooks) unrecoverable(ctx context.Context, held Holding, l *HookLedger, e *ledgerEntry, now time.Time, reason string) error {
	g := deliveryGap{Hook: l.Hook(), GUID: e.GUID, DeliveryID: e.Latest.ID, Event: e.Event, DeliveredAt: cmp.Or(e.FirstOK, e.Latest.DeliveredAt),
		FoundAt: now, UnrecoverableAt: &now, LastError: reason}
	recorded, err := h.recordGap(ctx, held, g, AlertIntent{Name: "gap", Action: "unrecoverable"})
	if err != nil {
		return err
	}
	if recorded {
		h.log.Warn("delivery gap, unrecoverable", "hook", l.String(), "github_delivery", e.Latest.ID, "reason", reason)
	}
	return nil
}

// refusedForGood are GitHub's answers to a redelivery that asking again
// will not change: the delivery is gone (404, 410) or cannot be redelivered
// (422).
var refusedForGood = []int{http.StatusNotFound, http.StatusGone, http.StatusUnprocessableEntity}

// maxRefusals is how many such answers make a gap unrecoverable.
const maxRefusals = 3

// redeliverGaps asks GitHub to deliver open gaps once more, the oldest
// first, as many as github.redeliver_per_minute lets through now; the rest
// wait for the next poll. A refusal is logged and asked again at a later
// poll; the third refusal for good makes the gap unrecoverable, alerted
// once and never asked for again.
func (h *Hooks) redeliverGaps(ctx context.Context, held Holding, l *HookLedger) error {
	if !h.redeliver {
		return nil
	}
	gaps, err := h.store.GapsToRedeliver(ctx, l.Hook(), l.RedeliverPerMinute())
	if err != nil {
		return err
	}
	for _, g := range gaps {
		if err := held.Check(); err != nil {
			return err
		}
		err := l.Redeliver(ctx, g.DeliveryID)
		if errors.Is(err, ErrRedeliveryPaced) {
			h.log.Debug("redeliveries paced: the rest wait for the next poll", "delivery_id", g.GUID)
			return nil
		}
		var se *githubStatusError
		if errors.As(err, &se) && slices.Contains(refusedForGood, se.Status) {
			gaveUp, rerr := h.gapRefused(ctx, held, l.Hook(), g.GUID, err)
			if rerr != nil {
				return rerr
			}
			if gaveUp {
				h.log.Warn("delivery gap, unrecoverable: GitHub refused its redelivery three times",
					"delivery_id", g.GUID, "github_delivery", g.DeliveryID, "error", err)
				continue
			}
		}
		if err != nil {
			h.log.Warn("GitHub did not take the redelivery of a gap, a later poll asks again",
				"delivery_id", g.GUID, "github_delivery", g.DeliveryID, "error", err)
			continue
		}
		h.log.Info("asked GitHub to redeliver a gap", "hook", l.String(), "delivery_id", g.GUID, "github_delivery", g.DeliveryID)
		if err := held.WriteTx(ctx, h.store, func(tx *Tx) error { return tx.GapRedelivered(ctx, l.Hook(), g.GUID, time.Now()) }); err != nil {
			return err
		}
	}
	return nil
}

// queue publishes one github-hooks message for l's failed delivery d, then
// remembers it.
func (h *Hooks) queue(ctx context.Context, held Holding, l *HookLedger, d hookDelivery) error {
	body, _ := json.Marshal(hookMessage{DeliveryID: d.ID, GUID: d.GUID, Hook: l.Hook()})
	hdr := http.Header{}
	hdr.Set(hdrDelivery, d.GUID)
	hdr.Set(hdrEvent, d.Event)
	if err := held.Check(); err != nil {
		return err
	}
	if _, err := h.queues.PublishToTarget(ctx, h.brokers, "", queueHooks, newPublishing(hdr, body, "", time.Now())); err != nil {
		return fmt.Errorf("queue redelivery of %s: %w", d.GUID, err)
	}
	h.log.Info("queued a failed delivery for redelivery", "hook", l.String(), "delivery_id", d.GUID, "event", d.Event, "github_delivery", d.ID)
	return held.WriteTx(ctx, h.store, func(tx *Tx) error { return tx.HookQueued(ctx, l.Hook(), d.GUID, d.ID, d.Event) })
}

// recordGap records gap g, with its alert on the channels intent's rules
// name; recorded is false when the gap was known.
func (h *Hooks) recordGap(ctx context.Context, held Holding, g deliveryGap, intent AlertIntent) (recorded bool, err error) {
	err = held.WriteTx(ctx, h.store, func(tx *Tx) (err error) {
		recorded, err = tx.RecordGap(ctx, g, h.alerter.ChannelsFor(intent))
		return err
	})
	return recorded, err
}

// gapRefused counts GitHub's refusal (why) of hook's redelivery of guid;
// gaveUp reports that it made the gap unrecoverable, its alert queued.
func (h *Hooks) gapRefused(ctx context.Context, held Holding, hook int64, guid string, why error) (gaveUp bool, err error) {
	err = held.WriteTx(ctx, h.store, func(tx *Tx) (err error) {
		gaveUp, err = tx.GapRefused(ctx, hook, guid, why.Error(), maxRefusals, h.alerter.ChannelsFor(AlertIntent{Name: "gap", Action: "unrecoverable"}))
		return err
	})
	return gaveUp, err
}
