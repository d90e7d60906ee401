package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Whether the database answers. A node that loses PostgreSQL (the
// connection refused, dropped or silent) stops consuming at once and
// leaves its messages unacknowledged, so that the broker hands them to
// another node and no attempt is burned; it keeps answering webhooks,
// and consumes again once the database answers. SQLite is a file: it is
// never lost.

// ErrDatabaseLost is a write that failed because the connection to the
// database failed: no fault of the message, which another node (or this
// one, once the database answers) takes.
var ErrDatabaseLost = errors.New("database connection lost")

// ErrSchemaFloor is a database whose schema floor is above this binary's
// version (store_schema.go): this binary no longer works with it, and
// the node stops writing as for a lost database until it does.
var ErrSchemaFloor = errors.New("upgrade switchyard")

// probeEvery is how often a lost database is asked whether it answers.
const probeEvery = 500 * time.Millisecond

// dbHealth follows whether the database answers. Once a connection fails
// (observe, or Lose), the database is lost: the channel Lost returned is
// closed, and a prober pings it until it answers, when a new channel
// stands for the next loss.
type dbHealth struct {
	engine engine
	w      *sql.DB
	// also is what a ping must pass besides answering (require).
	also atomic.Pointer[func(ctx context.Context) error]

	mu      sync.Mutex
	lost    chan struct{} // closed while lost; a fresh one once it answers
	answers chan struct{} // closed once it answers again
	down    bool
	cause   error
	since   time.Time
	closed  bool

	probing sync.WaitGroup
	stop    chan struct{}
}

// newDBHealth follows the database of w, whose engine is e.
func newDBHealth(e engine, w *sql.DB) *dbHealth {
	answers := make(chan struct{})
	close(answers)
	return &dbHealth{engine: e, w: w, lost: make(chan struct{}), answers: answers, stop: make(chan struct{})}
}

// observe returns err, as ErrDatabaseLost when it is the connection to
// PostgreSQL failing, which makes the database lost.
func (h *dbHealth) observe(err error) error {
	if errors.Is(err, ErrDatabaseLost) || !h.engine.lost(err) {
		return err
	}
	h.Lose(err)
	return fmt.Errorf("%w: %w", ErrDatabaseLost, err)
}

// Lose marks the database lost, for cause, until it answers a ping. The
// lease keeper calls it when the database stops answering altogether.
func (h *dbHealth) Lose(cause error) {
	if !h.engine.shared() {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.down || h.closed {
		return
	}
	h.down, h.cause, h.since = true, cause, time.Now()
	h.engine.idle(h.w, false) // the next connections dial anew
	h.answers = make(chan struct{})
	close(h.lost)
	h.probing.Go(h.probe)
}

// require adds check to what a lost database must pass to be found again.
func (h *dbHealth) require(check func(ctx context.Context) error) { h.also.Store(&check) }

// refusal is why the database may not be written now by this binary, nil
// unless it is lost for its schema floor.
func (h *dbHealth) refusal() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.down && errors.Is(h.cause, ErrSchemaFloor) {
		return h.cause
	}
	return nil
}

// probe pings the database until it answers, then marks it found.
func (h *dbHealth) probe() {
	t := time.NewTicker(probeEvery)
	defer t.Stop()
	for {
		select {
		case <-h.stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := h.engine.ping(ctx, h.w)
		if also := h.also.Load(); err == nil && also != nil {
			err = (*also)(ctx)
		}
		cancel()
		if err == nil {
			h.engine.idle(h.w, true)
			h.mu.Lock()
			h.down, h.cause = false, nil
			h.lost = make(chan struct{})
			close(h.answers)
			h.mu.Unlock()
			return
		}
	}
}

// Lost returns a channel closed once the database is lost (now, or
// later): a consumer stops at once when it closes. Take it before the
// work it guards.
func (h *dbHealth) Lost() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.lost
}

// Down reports whether the database is lost now, since when and why.
func (h *dbHealth) Down() (bool, time.Time, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.down, h.since, h.cause
}

// WaitAnswers waits while the database is lost, until it answers or ctx
// ends.
func (h *dbHealth) WaitAnswers(ctx context.Context) error {
	h.mu.Lock()
	answers := h.answers
	h.mu.Unlock()
	select {
	case <-answers:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// close stops the prober, and waits for it.
func (h *dbHealth) close() {
	h.mu.Lock()
	if !h.closed {
		h.closed = true
		close(h.stop)
	}
	h.mu.Unlock()
	h.probing.Wait()
}
