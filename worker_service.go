package main

import (
	"context"
	"database/sql"
)

// serviceHandler is the service worker's handler (queue github), and with
// forbidden set the cleanup worker's (queue github-forbidden): the raw Event
// and its 6-hour count, in one transaction.
func serviceHandler(store *Store, forbidden bool) Handler {
	return func(ctx context.Context, ev *Event) error {
		inserted, err := store.InsertEvent(ctx, ev, forbidden)
		if err != nil {
			return err
		}
		if !inserted {
			return ErrDuplicate
		}
		return nil
	}
}

// databaseHandler is the database-service worker's handler (queue
// github-database). It records each delivery once per worker; the typed
// github_* tables and release tracking of SPEC §9 and §10 are written inside
// that same transaction as they land.
func databaseHandler(store *Store) Handler {
	return func(ctx context.Context, ev *Event) error {
		done, err := store.MarkDelivery(ctx, "database-service", ev.DeliveryID, func(tx *sql.Tx) error {
			return nil
		})
		if err != nil {
			return err
		}
		if !done {
			return ErrDuplicate
		}
		return nil
	}
}
