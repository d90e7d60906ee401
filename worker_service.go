package main

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
)

// serviceHandler is the service worker's handler (queue github), and with
// forbidden set the cleanup worker's (queue github-forbidden): the raw Event
// and its 6-hour count in one transaction, then the alert when a rule matches.
//
// The alert is sent at most once per delivery: each channel's send is
// recorded, and a retry after a failed send repeats only the channels that
// have not sent, never the row or the count. (A crash between a send and its
// record can repeat that one send: at least once, for alerts.)
func serviceHandler(store *Store, alerter *Alerter, forbidden bool, log *slog.Logger) Handler {
	return func(ctx context.Context, ev *Event) error {
		inserted, err := store.InsertEvent(ctx, ev, forbidden)
		if err != nil {
			return err
		}
		channels := alerter.Channels(ev)
		if len(channels) == 0 {
			if !inserted {
				return ErrDuplicate
			}
			return nil
		}
		sent, alerted, err := store.AlertProgress(ctx, ev.DeliveryID)
		if err != nil {
			return err
		}
		if alerted {
			if !inserted {
				return ErrDuplicate
			}
			return nil
		}
		var todo []string
		for _, c := range channels {
			if !slices.Contains(sent, c) {
				todo = append(todo, c)
			}
		}
		if len(todo) == 0 {
			if !inserted {
				return ErrDuplicate
			}
			return nil
		}
		for i, c := range todo {
			if err := alerter.Send(ctx, c, ev, forbidden); err != nil {
				return fmt.Errorf("alert: %w", err)
			}
			if err := store.RecordAlertSend(ctx, ev.DeliveryID, c, i == len(todo)-1); err != nil {
				return err
			}
			loggerFrom(ctx, log).Info("alert sent", "channel", c)
		}
		return nil
	}
}
