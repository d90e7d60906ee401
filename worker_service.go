package main

import (
	"context"
)

// serviceHandler is the service worker's handler (queue github), and with
// forbidden set the cleanup worker's (queue github-forbidden): the raw Event,
// its 6-hour count and, when a rule matches, its alerts queued in
// alert_outbox, all in one transaction; a hook's copy resolves that hook's
// gap (the App's copy, of github.app_id appID, the App hook's). The alerts
// go out after the commit (AlertSender): nothing here waits on the network
// while the transaction is open, and a retried or redelivered message
// changes nothing the second time.
func serviceHandler(alerter *Alerter, appID int64, forbidden bool) Handler {
	return func(ctx context.Context, tx *Tx, d Decoded) (Found, error) {
		ev := d.Event
		inserted, err := tx.InsertEvent(ctx, ev, forbidden, alerter.Channels(ev)...)
		if err != nil {
			return Found{}, err
		}
		if !inserted {
			return Found{}, ErrDuplicate
		}
		hook := ev.HookID // a repository's or organization's hook's ledger
		if ev.AppCopy(appID) {
			hook = 0 // the App's own hook's
		}
		return Found{}, tx.ResolveGap(ctx, hook, ev.DeliveryID)
	}
}
