package main

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"
)

// AlertSender sends the alerts that handlers queued in alert_outbox, after
// their transactions committed. Each channel has a loop of its
// own, so a stalled SMTP server does not hold the push alerts back; a failed
// send is tried again with backoff, and an alert goes out at least once.
type AlertSender struct {
	store   *Store
	alerter *Alerter
	log     *slog.Logger
	// every is how often a channel looks for due alerts; minBackoff and
	// maxBackoff bound the wait after a failed send, doubled per failure.
	every, minBackoff, maxBackoff time.Duration
}

// NewAlertSender sends alerter's alerts from store's outbox.
func NewAlertSender(store *Store, alerter *Alerter, log *slog.Logger) *AlertSender {
	return &AlertSender{store: store, alerter: alerter, log: log.With("worker", "alerts"),
		every: time.Second, minBackoff: time.Second, maxBackoff: 10 * time.Minute}
}

// alertSendTimeout bounds one send; the channels' clients have their own.
const alertSendTimeout = 30 * time.Second

// Run sends due alerts on every channel until ctx ends, under h (the
// alerts lease's holding).
func (s *AlertSender) Run(ctx context.Context, h Holding) error {
	var wg sync.WaitGroup
	for _, channel := range []string{"email", "push"} {
		wg.Go(func() {
			t := time.NewTicker(s.every)
			defer t.Stop()
			for {
				s.sendDue(ctx, h, channel)
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
			}
		})
	}
	wg.Wait()
	return nil
}

// sendDue sends channel's due alerts, oldest first. A failure ends the pass:
// the channel is likely down, and the rest would fail the same way.
func (s *AlertSender) sendDue(ctx context.Context, h Holding, channel string) {
	due, err := s.store.DueAlerts(ctx, channel, time.Now(), 50)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("cannot read due alerts", "channel", channel, "error", err)
		}
		return
	}
	for _, a := range due {
		log := s.log.With("channel", channel, "delivery_id", a.Event.DeliveryID, "event", a.Event.Name)
		if !h.Held() {
			return // another node sends it now
		}
		sctx, cancel := context.WithTimeout(ctx, alertSendTimeout)
		sendErr := s.alerter.Send(sctx, channel, a.Event, a.Forbidden)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if sendErr != nil {
			backoff := min(s.minBackoff<<min(a.Attempts, 20), s.maxBackoff)
			backoff = backoff/2 + rand.N(backoff/2+1)
			// Logged once recorded: the line says the retry is due.
			if err := h.WriteTx(ctx, s.store, func(tx *Tx) error { return tx.AlertFailed(ctx, a.ID, sendErr, time.Now().Add(backoff)) }); err != nil {
				log.Warn("cannot record the failed alert", "error", err)
			}
			log.Warn("alert not sent, will retry", "attempt", a.Attempts+1, "retry_in", backoff.Round(time.Millisecond), "error", sendErr)
			return
		}
		if err := h.WriteTx(ctx, s.store, func(tx *Tx) error { return tx.AlertSent(ctx, a.ID, a.Event.DeliveryID) }); err != nil {
			// Sent, but not recorded: it goes out again (at least once).
			log.Warn("alert sent but not recorded", "error", err)
			return
		}
		log.Info("alert sent")
	}
}
