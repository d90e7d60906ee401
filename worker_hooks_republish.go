package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"time"
)

// HandleMessages is the github-hooks consumer. Its messages are its own
// (hookMessage), never read as Events: each names a delivery whose
// original request is fetched from GitHub and republished through
// github-exchange, so that both the raw log and the typed tables get the
// Event. It talks to GitHub and the broker, so it never batches: it opens a
// transaction of its own once the network is done with. Each message is a
// consumer span, under which the republish is traced: the republished
// delivery's trace begins at the hooks worker.
func (h *Hooks) HandleMessages(ctx context.Context, held Holding, msgs []Message) ([]error, error) {
	verdicts := make([]error, len(msgs))
	spans := h.tracer.startConsumes(ctx, queueHooks, msgs)
	for i := range msgs {
		verdicts[i] = h.handle(spans.context(ctx, i), held, &msgs[i])
	}
	spans.end(verdicts, nil)
	return verdicts, nil
}

// handle republishes the delivery one github-hooks message names.
func (h *Hooks) handle(ctx context.Context, held Holding, msg *Message) error {
	var m hookMessage
	if err := json.Unmarshal(msg.Body, &m); err != nil || m.DeliveryID == 0 || m.GUID == "" {
		return permanent("github-hooks message without delivery_id or guid")
	}
	nameDelivery(ctx, m.GUID)
	l := h.ledgerOf(m.Hook)
	if l == nil {
		return permanent("github-hooks message of hook %d, whose ledger is not configured (github.hooks, github.app_id)", m.Hook)
	}
	key := DeliveryKey{Hook: m.Hook, GUID: m.GUID}
	if done, err := h.store.Finished(ctx, "hooks", key); err != nil || done {
		return cmp.Or(err, ErrDuplicate)
	}
	d, err := l.Delivery(ctx, m.DeliveryID)
	var se *githubStatusError
	if errors.As(err, &se) && (se.Status == http.StatusNotFound || se.Status == http.StatusGone) {
		return permanent("GitHub no longer has delivery %d of %s (%d): older than its delivery window", m.DeliveryID, l, se.Status)
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
	// It is the hook's own copy, whatever GitHub's record kept of the
	// request: the ledger counts it stored from that copy only.
	l.copyHeaders(hdr)
	// The headers become the message's, as a webhook's do: checked first,
	// so that nothing in them can close the shared connection.
	if err := checkHeaders(hdr); err != nil {
		return permanent("delivery %d: %v", m.DeliveryID, err)
	}
	payload := unwrapPayload(d.Request.Payload)
	if _, _, err := decodePayload(payload, hdr.Get(hdrEvent)); err != nil {
		return permanent("delivery %d: %v", m.DeliveryID, err)
	}
	if err := held.Check(); err != nil {
		return err
	}
	_, err = h.queues.PublishToTarget(ctx, h.brokers, exchangeName, "", newPublishing(hdr, payload, "", time.Now()))
	var tooLarge *TooLargeError
	if errors.As(err, &tooLarge) {
		return permanent("delivery %d: %v", m.DeliveryID, err)
	}
	if err != nil {
		return fmt.Errorf("republish %s: %w", d.GUID, err)
	}
	return held.WriteTx(ctx, h.store, func(tx *Tx) error {
		_, err := tx.MarkDelivery(ctx, "hooks", key, func(tx *Tx) (string, error) {
			return "", tx.hookRepublished(ctx, m.Hook, m.GUID)
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
	// The operator's press, on whichever node answers it: under no lease
	// (an asked gap is marked so on every node alike).
	held := Holding{}
	hook, id, asked, err := h.store.GitHubAttempt(ctx, guid)
	l := h.ledgerOf(hook)
	switch {
	case err != nil:
		return "", err
	case id == 0 || l == nil:
		return redeliverUnknown, nil
	case asked != nil:
		return redeliverAgain, nil
	}
	err = l.Redeliver(ctx, id)
	var se *githubStatusError
	switch {
	case errors.Is(err, ErrRedeliveryPaced):
		return redeliverPaced, nil
	case errors.As(err, &se) && slices.Contains(refusedForGood, se.Status):
		if _, err := h.gapRefused(ctx, held, hook, guid, err); err != nil {
			return "", err
		}
		return redeliverRefused, nil
	case err != nil:
		return "", err
	}
	// A gap keeps when it was asked; a failed delivery GitHub was asked to
	// send again is asked once more only by a new press.
	if err := held.WriteTx(ctx, h.store, func(tx *Tx) error { return tx.GapRedelivered(ctx, hook, guid, time.Now()) }); err != nil {
		return "", err
	}
	return redeliverAsked, nil
}
