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
	"strconv"
	"sync/atomic"
	"time"
)

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
	// grace is github.reconcile_grace; redeliver is github.redeliver_gaps;
	// maxPages is github.max_pages_per_poll.
	grace     time.Duration
	redeliver bool
	maxPages  int
	// pollTimeout bounds one poll; zero is ledgerTimeout.
	pollTimeout time.Duration
	log         *slog.Logger
	// holding is the hooks lease's, while its job runs (Under): every
	// write of the worker is made under it.
	holding atomic.Pointer[Holding]
}

// Under runs the hooks worker w as the hooks lease's job, holding h: its
// writes are fenced by h's term.
func (h *Hooks) Under(w *Worker) func(ctx context.Context, held Holding) error {
	return func(ctx context.Context, held Holding) error {
		h.holding.Store(&held)
		defer h.holding.Store(nil)
		return w.Run(ctx)
	}
}

// write runs fn in a write transaction under the hooks lease's holding
// (none outside its job: a test's, a command's).
func (h *Hooks) write(ctx context.Context, fn func(tx *Tx) error) error {
	held := Holding{}
	if p := h.holding.Load(); p != nil {
		held = *p
	}
	return held.WriteTx(ctx, h.store, fn)
}

// NewHooks is the hooks worker's work for cfg, through app.
func NewHooks(cfg *Config, app *GitHubApp, store *Store, brokers *Brokers, queues *Queues, alerter *Alerter, log *slog.Logger) *Hooks {
	return &Hooks{app: app, store: store, brokers: brokers, queues: queues, alerter: alerter,
		grace: cfg.GitHub.ReconcileGrace, redeliver: cfg.GitHub.RedeliverGaps, maxPages: cfg.GitHub.MaxPagesPerPoll, log: log}
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

// ledger lists GitHub's deliveries since since, at most maxPages pages, and
// classifies them. complete reports whether the listing got back to since.
func ledger(ctx context.Context, app *GitHubApp, store *Store, since, now time.Time, grace time.Duration, maxPages int) (
	entries []*ledgerEntry, queued map[string]bool, complete bool, err error) {
	fold := newAttemptFold()
	complete, err = app.EachDeliveryPage(ctx, since, maxPages, func(page []hookDelivery) error {
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
	stored, queued, err := store.LedgerLookup(ctx, app.ID(), guids)
	if err != nil {
		return nil, nil, false, err
	}
	classify(fold.entries, stored, now, grace)
	return fold.entries, queued, complete, nil
}

// Poll pages every delivery since the checkpoint (never more than GitHub's 3
// days, nor github.max_pages_per_poll pages, within ledgerTimeout) and
// accounts for each GUID: one with no 2xx attempt, neither stored nor queued
// already, is queued on github-hooks; a gap is recorded, alerted once and,
// with redeliver on, redelivered by GitHub at the pace
// github.redeliver_per_minute allows; every open gap whose GUID is stored
// now is resolved. A GUID or event from the API that no message may carry
// makes an unrecoverable gap instead. The checkpoint moves to now, but never
// past a delivery still in flight, nor when the listing stopped short: later
// polls look again. It moves only after a poll that did all it found.
func (h *Hooks) Poll(ctx context.Context) (queued int, err error) {
	ctx, cancel := context.WithTimeout(ctx, cmp.Or(h.pollTimeout, ledgerTimeout))
	defer cancel()
	now := time.Now().UTC()
	since := now.Add(-githubRedeliveryWindow)
	cp, err := h.store.Setting(ctx, keyHooksCheckpoint)
	if err != nil {
		return 0, err
	}
	if t, err := time.Parse(time.RFC3339Nano, cp); err == nil && t.Add(-checkpointOverlap).After(since) {
		since = t.Add(-checkpointOverlap)
	}
	entries, known, complete, err := ledger(ctx, h.app, h.store, since, now, h.grace, cmp.Or(h.maxPages, 100))
	if err != nil {
		return 0, err
	}
	if err := h.recordAttempts(ctx, entries, now); err != nil {
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
			if err := h.unrecoverable(ctx, e, now, reason); err != nil {
				return queued, err
			}
			continue
		}
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
	if h.store.MayHaveOpenGaps() {
		var n int64
		if err := h.write(ctx, func(tx *Tx) (err error) { n, err = tx.ResolveStoredGaps(ctx, h.app.ID()); return err }); err != nil {
			return queued, err
		}
		if n > 0 {
			h.log.Info("delivery gaps resolved: stored now", "gaps", n)
		}
	}
	err = h.write(ctx, func(tx *Tx) error { return tx.SetSetting(ctx, keyHooksCheckpoint, formatTime(checkpoint), time.Now()) })
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
func (h *Hooks) recordAttempts(ctx context.Context, entries []*ledgerEntry, now time.Time) error {
	var attempts []hookDelivery
	for _, e := range entries {
		if apiDeliveryProblem(e) == "" {
			attempts = append(attempts, e.Attempts...)
		}
	}
	return h.write(ctx, func(tx *Tx) error { return tx.RecordAttempts(ctx, attempts, now.Add(-githubRedeliveryWindow)) })
}

// gap records a gap the first time a poll finds it, with its alert.
func (h *Hooks) gap(ctx context.Context, e *ledgerEntry, now time.Time) error {
	g := deliveryGap{GUID: e.GUID, DeliveryID: e.Latest.ID, Event: e.Event, DeliveredAt: e.FirstOK, FoundAt: now}
	recorded, err := h.recordGap(ctx, g, AlertIntent{Name: "gap", Action: e.Event})
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

// unrecoverable records e as a gap given up on at once, with its alert,
// the first time a poll finds it: reason says why.
func (h *Hooks) unrecoverable(ctx context.Context, e *ledgerEntry, now time.Time, reason string) error {
	g := deliveryGap{GUID: e.GUID, DeliveryID: e.Latest.ID, Event: e.Event, DeliveredAt: cmp.Or(e.FirstOK, e.Latest.DeliveredAt),
		FoundAt: now, UnrecoverableAt: &now, LastError: reason}
	recorded, err := h.recordGap(ctx, g, AlertIntent{Name: "gap", Action: "unrecoverable"})
	if err != nil {
		return err
	}
	if recorded {
		h.log.Warn("delivery gap, unrecoverable", "github_delivery", e.Latest.ID, "reason", reason)
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
func (h *Hooks) redeliverGaps(ctx context.Context) error {
	if !h.redeliver {
		return nil
	}
	gaps, err := h.store.GapsToRedeliver(ctx, h.app.RedeliverPerMinute())
	if err != nil {
		return err
	}
	for _, g := range gaps {
		err := h.app.Redeliver(ctx, g.DeliveryID)
		if errors.Is(err, ErrRedeliveryPaced) {
			h.log.Debug("redeliveries paced: the rest wait for the next poll", "delivery_id", g.GUID)
			return nil
		}
		var se *githubStatusError
		if errors.As(err, &se) && slices.Contains(refusedForGood, se.Status) {
			gaveUp, rerr := h.gapRefused(ctx, g.GUID, err)
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
		h.log.Info("asked GitHub to redeliver a gap", "delivery_id", g.GUID, "github_delivery", g.DeliveryID)
		if err := h.write(ctx, func(tx *Tx) error { return tx.GapRedelivered(ctx, g.GUID, time.Now()) }); err != nil {
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
	if _, err := h.queues.PublishToTarget(ctx, h.brokers, "", queueHooks, newPublishing(hdr, body, "", time.Now())); err != nil {
		return fmt.Errorf("queue redelivery of %s: %w", d.GUID, err)
	}
	h.log.Info("queued a failed delivery for redelivery", "delivery_id", d.GUID, "event", d.Event, "github_delivery", d.ID)
	return h.write(ctx, func(tx *Tx) error { return tx.HookQueued(ctx, d.GUID, d.ID, d.Event) })
}

// recordGap records gap g, with its alert on the channels intent's rules
// name; recorded is false when the gap was known.
func (h *Hooks) recordGap(ctx context.Context, g deliveryGap, intent AlertIntent) (recorded bool, err error) {
	err = h.write(ctx, func(tx *Tx) (err error) {
		recorded, err = tx.RecordGap(ctx, g, h.alerter.ChannelsFor(intent))
		return err
	})
	return recorded, err
}

// gapRefused counts GitHub's refusal (why) of guid's redelivery; gaveUp
// reports that it made the gap unrecoverable, its alert queued.
func (h *Hooks) gapRefused(ctx context.Context, guid string, why error) (gaveUp bool, err error) {
	err = h.write(ctx, func(tx *Tx) (err error) {
		gaveUp, err = tx.GapRefused(ctx, guid, why.Error(), maxRefusals, h.alerter.ChannelsFor(AlertIntent{Name: "gap", Action: "unrecoverable"}))
		return err
	})
	return gaveUp, err
}

// HandleMessages is the github-hooks consumer. Its messages are its own
// (hookMessage), never read as Events: each names a delivery whose
// original request is fetched from GitHub and republished through
// github-exchange, so that both the raw log and the typed tables get the
// Event. It talks to GitHub and the broker, so it never batches: it opens a
// transaction of its own once the network is done with. Each message is a
// consumer span, under which the republish is traced: the republished
// delivery's trace begins at the hooks worker.
func (h *Hooks) HandleMessages(ctx context.Context, msgs []Message) ([]error, error) {
	verdicts := make([]error, len(msgs))
	spans := startConsumes(ctx, queueHooks, msgs)
	for i := range msgs {
		verdicts[i] = h.handle(spans.context(ctx, i), &msgs[i])
	}
	spans.end(verdicts, nil)
	return verdicts, nil
}

// handle republishes the delivery one github-hooks message names.
func (h *Hooks) handle(ctx context.Context, msg *Message) error {
	var m hookMessage
	if err := json.Unmarshal(msg.Body, &m); err != nil || m.DeliveryID == 0 || m.GUID == "" {
		return permanent("github-hooks message without delivery_id or guid")
	}
	nameDelivery(ctx, m.GUID)
	if done, err := h.store.Finished(ctx, "hooks", DeliveryKey{GUID: m.GUID}); err != nil || done {
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
	// It is the App hook's copy, whatever GitHub's record kept of the
	// request: the ledger counts it stored from that copy only, and the
	// typed tables are filled from it.
	hdr.Set(hdrTargetType, "integration")
	hdr.Set(hdrTargetID, strconv.FormatInt(h.app.ID(), 10))
	// The headers become the message's, as a webhook's do: checked first,
	// so that nothing in them can close the shared connection.
	if err := checkHeaders(hdr); err != nil {
		return permanent("delivery %d: %v", m.DeliveryID, err)
	}
	payload := unwrapPayload(d.Request.Payload)
	if _, _, err := decodePayload(payload, hdr.Get(hdrEvent)); err != nil {
		return permanent("delivery %d: %v", m.DeliveryID, err)
	}
	_, err = h.queues.PublishToTarget(ctx, h.brokers, exchangeName, "", newPublishing(hdr, payload, "", time.Now()))
	var tooLarge *TooLargeError
	if errors.As(err, &tooLarge) {
		return permanent("delivery %d: %v", m.DeliveryID, err)
	}
	if err != nil {
		return fmt.Errorf("republish %s: %w", d.GUID, err)
	}
	return h.write(ctx, func(tx *Tx) error {
		_, err := tx.MarkDelivery(ctx, "hooks", DeliveryKey{GUID: m.GUID}, func(tx *Tx) (string, error) {
			return "", tx.hookRepublished(ctx, m.GUID)
		})
		return err
	})
}

// What RedeliverOne did.
const (
	redeliverAsked   = "asked"   // GitHub took the request
	redeliverAgain   = "already" // asked before: nothing sent
	redeliverUnknown = "unknown" // GitHub's id of the delivery is not known here
	redeliverPaced   = "paced"   // github.redeliver_per_minute reached: try in a minute
	redeliverRefused = "refused" // GitHub refused it (it no longer has it, or will not)
)

// RedeliverOne asks GitHub to deliver guid again, at the operator's
// request: only a delivery whose GitHub id the ledger knows (a gap, or a
// failed delivery it queued), only once, and within
// github.redeliver_per_minute like the poll's own requests. A refusal for
// good counts toward the gap's unrecoverable state as the poll's do.
func (h *Hooks) RedeliverOne(ctx context.Context, guid string) (string, error) {
	id, asked, err := h.store.GitHubAttempt(ctx, guid)
	switch {
	case err != nil:
		return "", err
	case id == 0:
		return redeliverUnknown, nil
	case asked != nil:
		return redeliverAgain, nil
	}
	err = h.app.Redeliver(ctx, id)
	var se *githubStatusError
	switch {
	case errors.Is(err, ErrRedeliveryPaced):
		return redeliverPaced, nil
	case errors.As(err, &se) && slices.Contains(refusedForGood, se.Status):
		if _, err := h.gapRefused(ctx, guid, err); err != nil {
			return "", err
		}
		return redeliverRefused, nil
	case err != nil:
		return "", err
	}
	// A gap keeps when it was asked; a failed delivery GitHub was asked to
	// send again is asked once more only by a new press.
	if err := h.write(ctx, func(tx *Tx) error { return tx.GapRedelivered(ctx, guid, time.Now()) }); err != nil {
		return "", err
	}
	return redeliverAsked, nil
}
