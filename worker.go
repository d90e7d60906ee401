package main

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"
)

// WorkerOptions make one worker: its queue, its cadence, and what it does
// besides consuming. Its constructor says what it does with its messages:
// NewEventWorker handles them as Events, NewMessageWorker as they are.
type WorkerOptions struct {
	Name  string
	Queue string
	// Window is how long one cycle consumes the active broker.
	Window time.Duration
	// Every, when set, is the pause between cycles (cleanup runs hourly);
	// zero runs cycles back to back.
	Every time.Duration
	// Poll, when set, runs at the start of a cycle once PollEvery has passed
	// since it last ran (hooks: ask GitHub), under the worker's holding.
	Poll      func(ctx context.Context, held Holding) error
	PollEvery time.Duration
	// Health pings the worker's HealthChecks URL; nil pings nothing.
	Health *HealthCheck
	// Metrics records the worker's cycles and leftover drains; nil records
	// nothing.
	Metrics *Metrics
	// Consumed are the logical queues the daemon's workers read, what a
	// Pending Switch waits for (Config.ConsumedQueues); nil means all four.
	Consumed []string
}

// Worker runs the broker-following cycle for one queue: complete a drained Pending
// Switch, drain leftovers from the other brokers, then consume the queue on the
// active broker for one window.
type Worker struct {
	WorkerOptions
	// events is how an Event worker handles its messages; messages, set
	// instead, handles them as they are (the hooks worker's own).
	events   *EventOptions
	messages HeldHandler
	lastPoll time.Time
	// lastLogged is the last failure logged at warn, and when.
	lastLogged   string
	lastLoggedAt time.Time

	cfg     WorkersConfig
	brokers *Brokers
	queues  *Queues
	log     *slog.Logger

	mu    sync.Mutex
	state WorkerState
}

// WorkerState is how a worker's cycles go, for the status page.
type WorkerState struct {
	Name  string `json:"name"`
	Queue string `json:"queue"`
	// LastCycle is when the worker was last known well (absent before
	// the first time): its consumer attached, or a cycle ended well.
	// Failures counts the cycles failed since, LastError says why the
	// last one failed: both tell the present, so they are cleared as soon
	// as the worker consumes again, not when its window ends.
	LastCycle time.Time `json:"last_cycle,omitzero"`
	Failures  int       `json:"failures"`
	LastError string    `json:"last_error,omitempty"`
	// Recovered is when the worker was last known well after failed
	// cycles (absent before the first such): when it came back.
	Recovered time.Time `json:"recovered,omitzero"`
	// LastStored is when a message of its queue last ended done, since
	// the daemon started (absent before the first).
	LastStored time.Time `json:"last_stored,omitzero"`
	// WindowEnds is when the window the worker consumes in now ends, and
	// NextCycle when its next cycle starts while it pauses between cycles
	// (cleanup reads github-forbidden once an hour): a worker that has not
	// finished a cycle yet is not stuck, and a webhook in github-forbidden
	// is read at NextCycle.
	WindowEnds time.Time `json:"window_ends,omitzero"`
	NextCycle  time.Time `json:"next_cycle,omitzero"`
}

// State returns the worker's state as of its last cycle.
func (w *Worker) State() WorkerState {
	w.mu.Lock()
	defer w.mu.Unlock()
	st := w.state
	st.Name, st.Queue, st.LastStored = w.Name, w.Queue, w.queues.LastDone(w.Queue)
	return st
}

func (w *Worker) record(err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		w.state.Failures++
		w.state.LastError = err.Error()
	} else {
		if w.state.Failures > 0 {
			w.state.Recovered = time.Now()
		}
		w.state.LastCycle, w.state.Failures, w.state.LastError = time.Now(), 0, ""
	}
	w.Metrics.cycle(w.Name, w.state.Failures, w.state.LastCycle)
}

// NewEventWorker builds a worker that handles its queue's messages as
// Events (e: Queue and Log are the worker's), over the shared brokers and
// queues.
func NewEventWorker(o WorkerOptions, e EventOptions, cfg WorkersConfig, brokers *Brokers, queues *Queues, log *slog.Logger) *Worker {
	w := newWorker(o, cfg, brokers, queues, log)
	w.events = &e
	return w
}

// HeldHandler handles a batch of a message worker's messages as a
// BatchHandler does, under the holding its worker runs in (Worker.Run).
type HeldHandler func(ctx context.Context, held Holding, msgs []Message) (verdicts []error, err error)

// NewMessageWorker builds a worker that handles its queue's messages as
// they are, with no transaction of the worker's (the hooks worker talks to
// GitHub per message).
func NewMessageWorker(o WorkerOptions, handle HeldHandler, cfg WorkersConfig, brokers *Brokers, queues *Queues, log *slog.Logger) *Worker {
	w := newWorker(o, cfg, brokers, queues, log)
	w.messages = handle
	return w
}

func newWorker(o WorkerOptions, cfg WorkersConfig, brokers *Brokers, queues *Queues, log *slog.Logger) *Worker {
	if o.Consumed == nil {
		o.Consumed = logicalQueues
	}
	o.Metrics.worker(o.Name)
	return &Worker{WorkerOptions: o, cfg: cfg, brokers: brokers, queues: queues, log: log.With("worker", o.Name, "queue", o.Queue)}
}

// batch is the Batcher the worker's transactions run on, nil for a worker
// that writes none.
func (w *Worker) batch() Batcher {
	if w.events == nil {
		return nil
	}
	return w.events.Batch
}

// Run repeats the cycle until ctx is done, under held: the hooks lease's
// holding for the hooks worker (Lease.Run hands it over), the zero Holding
// for a worker every node runs. A failed cycle is logged and tried again
// after a backoff with jitter; it never ends the worker.
func (w *Worker) Run(ctx context.Context, held Holding) error {
	failures := 0
	for ctx.Err() == nil {
		watch := w.brokers.Watch()
		w.Health.Start()
		err := w.cycle(ctx, held)
		if ctx.Err() != nil {
			return nil
		}
		w.record(err)
		if errors.Is(err, ErrDatabaseLost) && w.batch() != nil {
			// Its messages went back to the broker, for other nodes:
			// this one consumes again once the database answers.
			w.Health.Fail(err.Error())
			w.log.Warn("database lost: consuming stops until it answers", "error", err)
			if werr := w.batch().WaitAnswers(ctx); werr == nil {
				w.log.Info("database answers again: consuming")
			}
			continue
		}
		if err != nil {
			w.Health.Fail(err.Error())
			failures++
			backoff := min(500*time.Millisecond<<min(failures-1, 10), 15*time.Second)
			var back <-chan struct{}
			if brokerAway(err) {
				// The broker comes back when its connection does: the
				// consumer waits for it to be dialed (by whoever dials
				// first), and tries itself as often as the connection's
				// backoff lets a dial through.
				backoff = min(backoff, brokerRetry)
				if b, berr := w.brokers.Get(w.brokers.Cached().Active); berr == nil {
					back = w.queues.Back(b)
				}
			}
			backoff = backoff/2 + rand.N(backoff/2+1)
			w.logFailure(err, failures, backoff)
			w.sleep(ctx, backoff, watch, back)
			continue
		}
		w.Health.Success()
		if failures > 0 {
			w.log.Info("cycle succeeded again", "after_failures", failures)
		}
		failures = 0
		if w.Every > 0 {
			pause := w.Every
			if w.brokers.Cached().Pending != nil {
				pause = min(pause, w.cfg.PendingCheckInterval)
			}
			w.setSchedule(time.Time{}, time.Now().Add(pause))
			w.sleep(ctx, pause, watch, nil)
		}
	}
	return nil
}

// setSchedule records the current window's end and the next cycle's start
// for the status; a zero time is none.
func (w *Worker) setSchedule(windowEnds, nextCycle time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.state.WindowEnds, w.state.NextCycle = windowEnds.UTC(), nextCycle.UTC()
}

// brokerRetry is the longest a worker waits to try a broker that was
// away again: the connection's own backoff (brokerConn.maxBackoff).
const brokerRetry = time.Second

// brokerAway reports whether err is the broker away or refusing
// switchyard's user, which its connection's return ends.
func brokerAway(err error) bool {
	return errors.Is(err, ErrBrokerUnreachable) || errors.Is(err, ErrBrokerAccessRefused)
}

// failureLogEvery is how often a worker whose cycles keep failing for the
// same reason says so again.
const failureLogEvery = time.Minute

// logFailure logs a failed cycle: the first of a run, one whose error
// differs from the last logged, and then once a failureLogEvery; the rest
// at debug (a broker away is tried every second).
func (w *Worker) logFailure(err error, failures int, retry time.Duration) {
	args := []any{"error", err, "failures", failures, "retry_in", retry.Round(time.Millisecond)}
	msg := err.Error()
	for _, kind := range []error{ErrBrokerUnreachable, ErrBrokerAccessRefused} {
		if errors.Is(err, kind) {
			msg = kind.Error() // its text names the next try, which moves
		}
	}
	if failures == 1 || msg != w.lastLogged || time.Since(w.lastLoggedAt) >= failureLogEvery {
		w.lastLogged, w.lastLoggedAt = msg, time.Now()
		w.log.Warn("cycle failed", args...)
		return
	}
	w.log.Debug("cycle failed", args...)
}

// sleep waits d, or less when ctx ends, the broker state changes, or back
// (nil: none) closes.
func (w *Worker) sleep(ctx context.Context, d time.Duration, watch, back <-chan struct{}) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	case <-watch:
	case <-back:
	}
}

// cycle is one pass of the broker-following cycle, after the worker's own poll
// when one is due. A failed poll fails the cycle, but only after the rest of
// it ran: the queue is still worked.
func (w *Worker) cycle(ctx context.Context, held Holding) error {
	var pollErr error
	if w.Poll != nil && time.Since(w.lastPoll) >= w.PollEvery {
		w.lastPoll = time.Now()
		pollErr = w.Poll(ctx, held)
	}
	return errors.Join(w.work(ctx, held), pollErr)
}

func (w *Worker) work(ctx context.Context, held Holding) error {
	// A database lost ends the cycle at once: its consumers are cancelled
	// and what they hold is handed back (ConsumeOptions.HandBack).
	var lost <-chan struct{}
	if b := w.batch(); b != nil {
		lost = b.Lost()
		if closed(lost) {
			return ErrDatabaseLost
		}
	}
	ctx, stop := whileOpen(ctx, lost)
	defer stop()
	err := w.consumeCycle(ctx, held, lost)
	if closed(lost) {
		return errors.Join(ErrDatabaseLost, err)
	}
	return err
}

// consumeCycle is one cycle's work: the switch, the leftover drain, then a
// window of the active broker. lost, when it closes, hands the messages in
// hand back.
func (w *Worker) consumeCycle(ctx context.Context, held Holding, lost <-chan struct{}) error {
	watch := w.brokers.Watch()
	st, err := w.brokers.State(ctx)
	if err != nil {
		return err
	}
	if st.Pending != nil {
		flipped, err := w.brokers.CompleteIfDrained(ctx, func(ctx context.Context, b *Broker) (bool, error) {
			return w.queues.Drained(ctx, b, w.Consumed)
		})
		if err != nil {
			w.log.Warn("pending switch waits: cannot verify the active broker is drained",
				"active", st.Active, "target", st.Pending.Index, "error", err)
		} else if !flipped {
			w.log.Debug("pending switch waits: the active broker is not drained yet",
				"active", st.Active, "target", st.Pending.Index)
		}
		if flipped {
			watch = w.brokers.Watch()
			if st, err = w.brokers.State(ctx); err != nil {
				return err
			}
		}
	}

	w.drainLeftovers(ctx, held, st, watch, lost)

	window := w.Window
	if st.Pending != nil {
		window = min(window, w.cfg.PendingCheckInterval)
	}
	active, err := w.brokers.Get(st.Active)
	if err != nil {
		return err
	}
	w.setSchedule(time.Now().Add(window), time.Time{})
	defer w.setSchedule(time.Time{}, time.Time{})
	o := w.consumeOptions(held, w.log.With("broker", active.String()))
	o.HandBack = lost
	_, err = w.queues.Consume(ctx, active, o, window, watch)
	return err
}

// drainLeftovers takes this worker's queue from every broker except the active
// one and a Pending Switch's target, up to leftover_drain_limit messages in
// all. Those messages are older than anything on the active broker, so they go
// first. A broker that cannot be reached is a warning, never a failed cycle.
// The drain stops when the state changes under it (watch), so that it never
// acts on a state that is no longer true.
func (w *Worker) drainLeftovers(ctx context.Context, held Holding, st SwitchState, watch <-chan struct{}, lost <-chan struct{}) {
	unchanged := func() bool {
		// Another node may have changed the state: it is read again
		// before each message is taken, so that a broker named a Pending
		// Switch's target by a node's answer is never drained after it.
		if w.brokers.Shared() {
			_ = w.brokers.Refresh(ctx)
		}
		return Unchanged(watch)
	}
	remaining := w.cfg.LeftoverDrainLimit
	for _, b := range w.brokers.List() {
		if remaining <= 0 || ctx.Err() != nil {
			return
		}
		if b.Index == st.Active || (st.Pending != nil && b.Index == st.Pending.Index) {
			continue
		}
		log := w.log.With("broker", b.String())
		o := w.consumeOptions(held, log)
		o.HandBack = lost
		n, err := w.queues.Drain(ctx, b, o, remaining, unchanged)
		remaining -= n
		w.Metrics.leftover(w.Queue, n)
		if n > 0 {
			log.Info("leftover drain", "messages", n)
		} else if err == nil {
			log.Debug("leftover drain found nothing")
		}
		if err != nil {
			log.Warn("leftover drain skipped broker", "error", err)
		}
	}
}

// consumeOptions are what the worker's consumers and drains do with its
// queue's messages.
func (w *Worker) consumeOptions(held Holding, log *slog.Logger) ConsumeOptions {
	o := ConsumeOptions{Queue: w.Queue, Log: log}
	if w.messages != nil {
		o.Handle = func(ctx context.Context, msgs []Message) ([]error, error) { return w.messages(ctx, held, msgs) }
	}
	if w.events != nil {
		e := *w.events
		e.Queue, e.Log = w.Queue, log
		o = e.options()
	}
	o.Attached = func() { w.record(nil) }
	return o
}
