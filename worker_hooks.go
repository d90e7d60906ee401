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

// Hooks is the hooks worker's work: poll GitHub for deliveries that never got
// a 2xx, queue each once on github-hooks, and republish what the queue asks for.
type Hooks struct {
	app     *GitHubApp
	store   *Store
	brokers *Brokers
	queues  *Queues
	timeout time.Duration
	log     *slog.Logger
}

const keyHooksCheckpoint = "hooks.checkpoint"

// hookMessage is the body of a github-hooks message.
type hookMessage struct {
	DeliveryID int64  `json:"delivery_id"`
	GUID       string `json:"guid"`
}

// Poll lists the deliveries since the checkpoint (never more than GitHub's 3
// days), groups the attempts by GUID, and queues one github-hooks message for
// each GUID with no 2xx attempt that is neither stored in github nor queued
// already. The checkpoint moves only after a poll that queued all it found.
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
	deliveries, err := h.app.ListDeliveries(ctx, since)
	if err != nil {
		return 0, fmt.Errorf("list hook deliveries: %w", err)
	}

	type attempts struct {
		ok     bool
		latest hookDelivery
	}
	byGUID := map[string]*attempts{}
	var order []string
	for _, d := range deliveries {
		if d.GUID == "" {
			continue
		}
		a, seen := byGUID[d.GUID]
		if !seen {
			a = &attempts{latest: d}
			byGUID[d.GUID] = a
			order = append(order, d.GUID)
		}
		if d.StatusCode >= 200 && d.StatusCode < 300 {
			a.ok = true
		}
		if d.DeliveredAt.After(a.latest.DeliveredAt) {
			a.latest = d
		}
	}
	for _, guid := range order {
		a := byGUID[guid]
		if a.ok {
			continue
		}
		known, err := h.store.HookKnown(ctx, guid)
		if err != nil {
			return queued, err
		}
		if known {
			continue
		}
		if err := h.queue(ctx, a.latest); err != nil {
			return queued, err
		}
		queued++
	}
	if err := h.store.SetSetting(ctx, keyHooksCheckpoint, formatTime(now)); err != nil {
		return queued, err
	}
	return queued, nil
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
	if _, err := decodePayload(payload); err != nil {
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
