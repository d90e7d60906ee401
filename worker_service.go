package main

import "context"

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
