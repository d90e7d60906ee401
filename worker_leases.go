package main

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"sync"
	"time"
)

// Jobs that must run once among the nodes sharing a database, each on the
// holder of its lease (the leases table): the hooks worker (ledger polls,
// redeliveries, republish), the alert sender, the HealthChecks pings,
// raw retention, the brokers' keepalive, the budget alerts and
// rotation, and moving what an older version left in its spool into the
// outbox (whose drain in that version takes the same lease). Each node
// also holds a lease of its own, outboxJob, under which it forwards its
// outbox. Consuming is every node's: a delivery is stored once, the
// database decides inside the writing transaction.
const (
	jobHooks        = "hooks"
	jobAlerts       = "alerts"
	jobHealthChecks = "healthchecks"
	jobRetention    = "retention"
	jobKeepalive    = "keepalive"
	jobBudget       = "budget"
	jobSpool        = "spool" // an older version's spool (Outbox.MoveSpool)
	jobACME         = "acme"  // ordering and renewing the certificate (server.tls)
)

// outboxJobPrefix begins the name of each node's outbox lease.
const outboxJobPrefix = "outbox:"

// outboxJob is node's outbox lease, held by node while it lives: it
// forwards its outbox under it (Outbox.Forward).
func outboxJob(node string) string { return outboxJobPrefix + node }

// leaseJobs are the jobs of cfg: the hooks worker's only with a hook's
// delivery ledger (the App's, a repository's or an organization's
// webhook's), this node's outbox, and the certificate's orders with ACME.
func leaseJobs(cfg *Config) []string {
	jobs := []string{jobAlerts, jobHealthChecks, jobRetention, jobKeepalive, jobBudget, jobSpool, outboxJob(cfg.Server.NodeName)}
	if cfg.GitHub.HasLedgers() {
		jobs = append([]string{jobHooks}, jobs...)
	}
	if cfg.Server.TLS.ACME() {
		jobs = append(jobs, jobACME)
	}
	return jobs
}

// Leases keeps this node's row in nodes and takes, renews and gives up the
// leases of its jobs: every lease_ttl/3 one transaction writes the row and
// asks for every lease. A lease held is renewed only by its holder; one
// expired or absent goes to whoever asks first.
//
// Fencing: a holder counts its lease valid until two thirds of lease_ttl
// after it sent its last renewal that succeeded, on its own monotonic
// clock. The database's expiry is a whole lease_ttl after that renewal ran
// there, so a holder that cannot renew (the database lost, or slow) stops
// the job a third of lease_ttl before any other node can take the lease:
// no two nodes ever run one job at once.
type Leases struct {
	store   *Store
	node    string
	version string
	started time.Time
	ttl     time.Duration
	log     *slog.Logger
	leases  []*Lease

	// running counts the jobs running under a lease: the keeper gives
	// the leases up at shutdown only once they have ended, and none
	// starts once it is closing.
	mu      sync.Mutex
	running int
	ended   *sync.Cond
	closing bool
	// stopBy, when set, is when the shutdown must be over: the leases
	// are given up by then or left to expire.
	stopBy time.Time
	// onReaders hears, after each renewal, whether every live node reads
	// zstd messages (OnZstdReaders).
	onReaders func(all bool)
}

// Lease is one job's lease as this node holds it, or not.
type Lease struct {
	Job string
	ls  *Leases

	mu    sync.Mutex
	held  bool
	until time.Time     // valid until, on this node's clock
	term  int64         // the holding's term (leases.term)
	taken chan struct{} // closed once held; a fresh one after each loss
	lost  chan struct{} // closed when the holding ends
}

// NewLeases keeps node's leases of jobs in store, each lasting ttl, with
// a switchyard_lease_held gauge for each job.
func NewLeases(store *Store, node string, ttl time.Duration, jobs []string, metrics *Metrics, log *slog.Logger) *Leases {
	ls := &Leases{store: store, node: node, version: version, started: time.Now().UTC(), ttl: ttl,
		log: log.With("node", node)}
	ls.ended = sync.NewCond(&ls.mu)
	for _, job := range jobs {
		l := &Lease{Job: job, ls: ls, taken: make(chan struct{}), lost: make(chan struct{})}
		ls.leases = append(ls.leases, l)
		metrics.LeaseHeld(job, l.valid)
	}
	return ls
}

// OnZstdReaders has fn told, after each renewal, whether every live node
// (seen within 3 x lease_ttl, as the status counts them) reads
// zstd-compressed messages: an older node reads no message it cannot
// read. Set it before Run.
func (ls *Leases) OnZstdReaders(fn func(all bool)) { ls.onReaders = fn }

// Lease is job's lease; nil for a job not kept here, which runs always.
func (ls *Leases) Lease(job string) *Lease {
	if ls == nil {
		return nil
	}
	for _, l := range ls.leases {
		if l.Job == job {
			return l
		}
	}
	return nil
}

// Holds reports whether this node holds job's lease now (Lease.valid),
// for the status: a job acts only through the Holding it is handed.
func (ls *Leases) Holds(job string) bool {
	l := ls.Lease(job)
	return l != nil && l.valid()
}

// Node is this node's name.
func (ls *Leases) Node() string { return ls.node }

// Run keeps the node's row and the leases until ctx ends, then waits for
// the jobs to stop and gives the leases up, so that another node takes
// them at once.
func (ls *Leases) Run(ctx context.Context) error {
	every := ls.ttl / 3
	for {
		sent := time.Now()
		ls.renew(ctx, sent)
		next := sent.Add(every)
		for _, l := range ls.leases {
			next = l.expire(next)
		}
		t := time.NewTimer(time.Until(next))
		select {
		case <-ctx.Done():
			t.Stop()
			ls.release()
			return nil
		case <-t.C:
		}
	}
}

// renew writes the node's row and asks for every lease, within a sixth of
// lease_ttl: a database that does not answer by then is lost.
func (ls *Leases) renew(ctx context.Context, sent time.Time) {
	ctx, cancel := context.WithTimeout(ctx, ls.ttl/6)
	defer cancel()
	// Another node's migration may have raised the database's floor
	// above this binary: this node then stops writing (its consumers
	// stop as for a lost database, no attempt burned) and holds no lease.
	if err := ls.store.CheckFloor(ctx); errors.Is(err, ErrSchemaFloor) {
		if down, _, _ := ls.store.Down(); !down {
			ls.log.Error("this node stops consuming: upgrade it", "error", err)
		}
		ls.store.Lose(err)
		for _, l := range ls.leases {
			l.lose("the database needs a newer switchyard")
		}
		return
	}
	got, terms := make([]bool, len(ls.leases)), make([]int64, len(ls.leases))
	var zstdReaders bool
	err := ls.store.WriteTx(ctx, func(tx *Tx) error {
		if err := tx.SeeNode(ctx, ls.node, ls.version, ls.started); err != nil {
			return err
		}
		var err error
		if zstdReaders, err = tx.ZstdReaders(ctx, 3*ls.ttl); err != nil {
			return err
		}
		for i, l := range ls.leases {
			var err error
			if got[i], terms[i], err = tx.TakeLease(ctx, l.Job, ls.node, ls.ttl); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() != nil {
			ls.store.Lose(err)
		}
		if ctx.Err() == nil || errors.Is(ctx.Err(), context.DeadlineExceeded) {
			ls.log.Warn("cannot renew the leases; each job stops before its lease expires", "error", err)
		}
		return
	}
	if ls.onReaders != nil {
		ls.onReaders(zstdReaders) // before the jobs it lets start publish
	}
	for i, l := range ls.leases {
		l.renewed(got[i], terms[i], sent)
	}
	if ls.store.Shared() {
		_ = ls.store.NoteOpenGaps(ctx)
	}
}

// starting counts a job in, unless the keeper is closing.
func (ls *Leases) starting() bool {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.closing {
		return false
	}
	ls.running++
	return true
}

// ending counts a job out.
func (ls *Leases) ending() {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.running--
	ls.ended.Broadcast()
}

// StopBy bounds the giving up of the leases at shutdown: by then, or not
// at all (they expire after lease_ttl).
func (ls *Leases) StopBy(t time.Time) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	ls.stopBy = t
}

// release waits for the jobs to end, then gives every lease held up,
// within 2 s and by StopBy's time.
func (ls *Leases) release() {
	ls.mu.Lock()
	ls.closing = true
	for ls.running > 0 {
		ls.ended.Wait()
	}
	by := time.Now().Add(2 * time.Second)
	if !ls.stopBy.IsZero() && ls.stopBy.Before(by) {
		by = ls.stopBy
	}
	ls.mu.Unlock()
	ctx, cancel := context.WithDeadline(context.Background(), by)
	defer cancel()
	err := ls.store.WriteTx(ctx, func(tx *Tx) error {
		for _, l := range ls.leases {
			if l.valid() {
				if err := tx.ReleaseLease(ctx, l.Job, ls.node); err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		ls.log.Warn("leases not given up at shutdown; they expire after server.lease_ttl", "error", err)
	}
	for _, l := range ls.leases {
		l.lose("")
	}
}

// renewed records the answer to a renewal sent at sent: held, or taken by
// another node.
func (l *Lease) renewed(held bool, term int64, sent time.Time) {
	if !held {
		l.lose("held by another node")
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.until = sent.Add(l.ls.ttl * 2 / 3)
	if l.held && l.term != term {
		// Taken over and back between two renewals: a holding of its
		// own, whose job starts anew.
		l.held = false
		close(l.lost)
		l.taken = make(chan struct{})
	}
	l.term = term
	if !l.held {
		l.held = true
		close(l.taken)
		l.lost = make(chan struct{})
		l.ls.log.Info("lease taken", "job", l.Job)
	}
}

// expire ends the holding when its time is up, and returns the earlier of
// next and when it will be.
func (l *Lease) expire(next time.Time) time.Time {
	l.mu.Lock()
	held, until := l.held, l.until
	l.mu.Unlock()
	if !held {
		return next
	}
	if !time.Now().Before(until) {
		l.lose("not renewed in time")
		return next
	}
	if until.Before(next) {
		return until
	}
	return next
}

// lose ends the holding, if there is one, for reason ("" at shutdown).
func (l *Lease) lose(reason string) {
	shutdown := reason == ""
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.held {
		return
	}
	l.held = false
	close(l.lost)
	l.taken = make(chan struct{})
	if shutdown {
		l.ls.log.Info("lease given up at shutdown", "job", l.Job)
		return
	}
	l.ls.log.Warn("lease lost: the job stops on this node", "job", l.Job, "reason", reason)
}

// valid reports whether this node holds the lease now, on its monotonic
// clock: a holder paused past its lease (a frozen VM, SIGSTOP) finds it
// no longer held the moment it resumes, before its renewal loop runs and
// says so. A nil *Lease (a job not kept under a lease) is always held.
// A job asks it through its Holding (Holding.Held); the status and the
// metrics through Leases.Holds.
func (l *Lease) valid() bool {
	if l == nil {
		return true
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.held && time.Now().Before(l.until)
}

// Holding is this node's holding of a lease in one term, as Lease.Run
// hands it to its job: the one way a job acts under its lease. Its writes
// go through WriteTx, fenced by the term (a stale holding's change
// nothing), and a step that acts outside the process asks Held right
// before it acts. The zero Holding, a job kept under no lease, is always
// held and fences nothing.
type Holding struct {
	lease *Lease
	term  int64
	since time.Time // when this node took it; zero for the zero Holding
}

// Since is when this node took the holding: what a job made before it
// (a ping waiting) is not the holding's to act on. Zero for the zero
// Holding.
func (h Holding) Since() time.Time { return h.since }

// Held reports whether this node holds the lease now, in the holding's
// term, on its monotonic clock.
func (h Holding) Held() bool {
	if h.lease == nil {
		return true
	}
	h.lease.mu.Lock()
	term := h.lease.term
	h.lease.mu.Unlock()
	return term == h.term && h.lease.valid()
}

// ErrNotHeld is a step of a job under a lease this node no longer holds
// (Holding.Check): it was not taken.
var ErrNotHeld = errors.New("this node no longer holds the job's lease")

// Within is ctx, ended once the holding stops holding on this node's
// clock as it stands now (a renewal after does not extend it): a step that
// acts outside the process under it, a ping, is given up rather than done
// when a pause of the process outlasts the lease between the step's check
// (Held) and its act. The zero Holding's is ctx's.
func (h Holding) Within(ctx context.Context) (context.Context, context.CancelFunc) {
	if h.lease == nil {
		return context.WithCancel(ctx)
	}
	h.lease.mu.Lock()
	until := h.lease.until
	h.lease.mu.Unlock()
	return context.WithDeadline(ctx, until)
}

// Guard is c writing only while the holding holds, asked (Held) right
// before each write: a step outside the process that a pause overtook
// after its check, a request already being written when the process
// resumes past its lease, sends nothing more, rather than waiting on a
// timer (Within) that may fire after the write. The zero Holding's is c.
func (h Holding) Guard(c net.Conn) net.Conn {
	if h.lease == nil {
		return c
	}
	return heldConn{Conn: c, held: h}
}

// heldConn is a connection that writes only while held holds (Guard).
type heldConn struct {
	net.Conn
	held Holding
}

func (c heldConn) Write(b []byte) (int, error) {
	if err := c.held.Check(); err != nil {
		return 0, err
	}
	return c.Conn.Write(b)
}

// Check is nil while the holding holds (Held), else ErrNotHeld: a job's
// step that acts outside the process asks it right before it acts.
func (h Holding) Check() error {
	if !h.Held() {
		return ErrNotHeld
	}
	return nil
}

// WriteTx runs fn in a write transaction of store made under the holding
// (Store.WriteTxUnder).
func (h Holding) WriteTx(ctx context.Context, store *Store, fn func(tx *Tx) error) error {
	if h.lease == nil {
		return store.WriteTx(ctx, fn)
	}
	return store.WriteTxUnder(ctx, *h.fence(), fn)
}

// fence is the holding as the Fence of a write; nil for the zero
// Holding.
func (h Holding) fence() *Fence {
	if h.lease == nil {
		return nil
	}
	// A third of lease_ttl: what a paused holder's transaction may keep
	// locked, well before another node may take the lease.
	return &Fence{Job: h.lease.Job, Node: h.lease.ls.node, Term: h.term, Hold: h.lease.ls.ttl / 3}
}

// Run runs job whenever this node holds the lease, handing it the
// holding it acts through and a context that ends when the holding does,
// until ctx ends. job returns once its context has ended. A nil *Lease (a
// job kept under no lease) runs job at once, with the zero Holding.
func (l *Lease) Run(ctx context.Context, job func(ctx context.Context, h Holding) error) error {
	if l == nil {
		return job(ctx, Holding{})
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-l.whenTaken():
		}
		l.mu.Lock()
		lost, held := l.lost, l.held
		l.mu.Unlock()
		if !held {
			continue
		}
		if !l.ls.starting() {
			return nil
		}
		l.mu.Lock()
		h := Holding{lease: l, term: l.term, since: time.Now()}
		l.mu.Unlock()
		jctx, stop := whileOpen(ctx, lost)
		// Its writes are made under this holding (a stale one's change
		// nothing), and it asks the holding right before each step that
		// acts outside the process.
		err := job(jctx, h)
		stop()
		l.ls.ending()
		if err != nil && ctx.Err() == nil {
			l.ls.log.Warn("job under lease failed", "job", l.Job, "error", err)
		}
	}
}

// whenTaken is closed once this node holds the lease: at once while it
// does.
func (l *Lease) whenTaken() <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held {
		return closedChan
	}
	return l.taken
}

// closedChan is a channel that is closed.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()
