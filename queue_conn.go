package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The connection to one broker: one, shared by the webhook endpoint and
// every worker, dialed on demand with backoff and jitter; channels per
// use; every AMQP call bounded by call_timeout. It knows nothing of
// publishing or consuming (publisher and reader build on it), so a
// connection opened to count messages opens nothing else.

// Errors callers branch on.
var (
	ErrBrokerUnreachable = errors.New("broker unreachable")
	ErrCallTimeout       = errors.New("AMQP call timed out")
	// ErrBrokerBlocked is a publish refused at once because the broker
	// blocked the connection (connection.blocked: a resource alarm, or a
	// plan's quota): waiting out publish_timeout would change nothing.
	ErrBrokerBlocked = errors.New("broker blocked the connection")
	// ErrBrokerRefused is a publish the broker refused without blocking
	// the connection: a nacked confirm (a queue with overflow
	// reject-publish), or the publishing channel closed with a channel
	// error (LavinMQ low on disk: 406 PRECONDITION_FAILED).
	ErrBrokerRefused = errors.New("broker refusing publishes")
	// ErrBrokerAccessRefused is the broker refusing switchyard's user what
	// it asks: a login (a wrong password, a vhost that does not exist or
	// that the user may not use), or a declare, publish or consume its
	// permissions do not cover. Waiting changes nothing; the operator
	// must fix the user.
	ErrBrokerAccessRefused = errors.New("broker refuses access")
)

// BrokerRefusal is what the broker blocked (ErrBrokerBlocked) or refused
// (ErrBrokerRefused, ErrBrokerAccessRefused), with the broker's reason. The
// reason may name the user and the vhost, which on a hosted plan are the
// account: it is for the log and the operator's status, never for a public
// answer (those say only the kind).
type BrokerRefusal struct {
	Kind   error
	Reason string
}

func (r *BrokerRefusal) Error() string { return r.Kind.Error() + ": " + r.Reason }
func (r *BrokerRefusal) Unwrap() error { return r.Kind }

// brokerConn is the one connection to one broker. It starts one goroutine
// per connection it dials, watchBlocked, which ends when that connection
// closes.
type brokerConn struct {
	broker      *Broker
	callTimeout time.Duration
	// onDial prepares each new connection before it is used (declares the
	// topology, when configured to); nil for none.
	onDial  func(bc *brokerConn, conn *amqp.Connection) error
	metrics *Metrics
	log     *slog.Logger
	// Backoff between failed dials, doubled per failure up to maxBackoff,
	// with jitter. maxBackoff is a second: the spool's drain and the
	// workers ask for the broker at least that often, and a broker back
	// from its bad minute is used again within it, at the cost of a dial a
	// second to one that stays away. Fields so tests can shorten them.
	minBackoff, maxBackoff time.Duration

	lock chan struct{} // a mutex that a context can give up on
	conn *amqp.Connection
	// live is conn, for sever, which cannot wait for lock (a dial under
	// way holds it); severed, once sever was called: no dial after it.
	live    atomic.Pointer[amqp.Connection]
	severed atomic.Bool
	// watchers are the watchBlocked goroutines, one per connection dialed,
	// each ending when its connection closes; close waits for them.
	watchers sync.WaitGroup
	failures int
	retryAt  time.Time
	// lastErr is what the last dial said when it failed, nil once one
	// succeeded: an atomic, so that a caller that could not take lock
	// reads it too (cutShort).
	lastErr atomic.Pointer[error]
	// back is closed when a dial succeeds, so that whoever waits out a
	// failure (a worker's consumer) uses the broker again at once, whoever
	// dialed it; a failed dial after a success puts a new one in its place.
	back atomic.Pointer[chan struct{}]
	// upSince is when the connection was last dialed.
	upSince atomic.Pointer[time.Time]

	// inHand counts deliveries from this broker that a worker has taken and
	// not yet settled: the broker's ready counts do not show them.
	inHand atomic.Int64
	// blocked is the broker's reason while it blocks the connection
	// (connection.blocked), nil otherwise; watchBlocked keeps it. The
	// channel blockedSig points to is closed when a block begins, so that
	// publishes waiting on the broker give up at once; a new one replaces
	// it when the block ends.
	blocked    atomic.Pointer[blockedState]
	blockedSig atomic.Pointer[chan struct{}]
	// cut is a block whose connection closed before the broker lifted it
	// (a blocked connection reads nothing, and the calls on it time out):
	// the next connection's block, within blockGap, is the same one, with
	// its Since, so that it is alerted once and its length counts whole.
	// An unblock or a confirmed publish ends it.
	cut atomic.Pointer[cutBlock]
	// refused is the broker's last refusal of a publish while it holds:
	// from a refused publish until one is confirmed again. A refusing
	// broker is blocked too (Queues.Blocked), but publishes still go to
	// it, as no notification says when it takes them again.
	refused atomic.Pointer[blockedState]
	// sizeLimit is the broker's own max_message_size as it said when it
	// closed a channel on a message over it (0: not heard on this
	// connection). A broker reads its limit when it starts (RabbitMQ, for
	// each channel when it opens), so it is forgotten with the connection.
	sizeLimit atomic.Int64
	// published and delivered count the messages switchyard sent to this
	// broker and took from it (basic.deliver and basic.get-ok, redeliveries
	// included) since they were last taken: what a plan's quota counts.
	published, delivered atomic.Int64
}

// newBrokerConn prepares the connection to broker b; nothing is dialed yet.
func newBrokerConn(b *Broker, callTimeout time.Duration, onDial func(*brokerConn, *amqp.Connection) error, metrics *Metrics, log *slog.Logger) *brokerConn {
	bc := &brokerConn{broker: b, callTimeout: callTimeout, onDial: onDial, metrics: metrics, log: log,
		minBackoff: 200 * time.Millisecond, maxBackoff: time.Second, lock: make(chan struct{}, 1)}
	sig, back := make(chan struct{}), make(chan struct{})
	bc.blockedSig.Swap(&sig)
	bc.back.Store(&back)
	return bc
}

// Back is closed once the broker's connection is dialed after the last
// failed dial: a caller that failed waits on it, with its backoff.
func (bc *brokerConn) Back() <-chan struct{} { return *bc.back.Load() }

// connection returns the live connection, dialing one when there is none
// and the backoff since the last failure has passed. Within the backoff it
// fails at once, so a dead broker costs callers nothing.
//
// A caller whose ctx ends first, waiting for another's dial or in its own,
// is told what the last dial said, when one failed: a broker that answers
// a login after seconds (RabbitMQ refuses a wrong password after 3 s) is
// told as refusing access to a caller with a shorter deadline (/readyz),
// not as a timeout; and such a dial, cut short by its caller, is not the
// broker's failure and changes nothing of what the last one said. Nor is
// a dial whose caller gave up (ctx cancelled: a shutdown), whatever the
// last dial said.
func (bc *brokerConn) connection(ctx context.Context) (*amqp.Connection, error) {
	select {
	case bc.lock <- struct{}{}:
	case <-ctx.Done():
		return nil, bc.cutShort(ctx.Err())
	}
	defer func() { <-bc.lock }()

	if bc.conn != nil && !bc.conn.IsClosed() {
		return bc.conn, nil
	}
	b := bc.broker
	if bc.severed.Load() {
		return nil, dialFailure(b, errSevered)
	}
	if now := time.Now(); now.Before(bc.retryAt) {
		return nil, fmt.Errorf("%w (next try in %s)", dialFailure(b, bc.lastFailure()), bc.retryAt.Sub(now).Round(time.Millisecond))
	}
	conn, err := bc.dial(ctx)
	if err != nil && (errors.Is(ctx.Err(), context.Canceled) || ctx.Err() != nil && bc.lastFailure() != nil) {
		return nil, bc.cutShort(err)
	}
	if err != nil {
		bc.failures++
		backoff := min(bc.minBackoff<<min(bc.failures-1, 16), bc.maxBackoff)
		backoff = backoff/2 + rand.N(backoff/2+1) // jitter: brokers restarting see no thundering herd
		bc.retryAt = time.Now().Add(backoff)
		bc.lastErr.Store(&err)
		if p := bc.back.Load(); closed(*p) {
			next := make(chan struct{})
			bc.back.Store(&next)
		}
		return nil, dialFailure(b, err)
	}
	bc.live.Store(conn)
	if bc.severed.Load() { // sever came while the dial was under way
		_ = conn.CloseDeadline(time.Now())
		return nil, dialFailure(b, errSevered)
	}
	if bc.failures > 0 {
		bc.log.Info("broker reachable again", "broker", b.String(), "after_failures", bc.failures)
	}
	bc.conn, bc.failures = conn, 0
	bc.sizeLimit.Store(0)
	bc.lastErr.Store(nil)
	now := time.Now()
	bc.upSince.Store(&now)
	if p := bc.back.Load(); !closed(*p) {
		close(*p)
	}
	notes := conn.NotifyBlocked(make(chan amqp.Blocking, 4))
	bc.watchers.Go(func() { bc.watchBlocked(notes) })
	return conn, nil
}

// closed reports whether ch is closed (a nil ch never is).
func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// cutShort is the answer to a caller whose context ended (err) before a
// dial answered: what the last dial said, when one failed, else err.
func (bc *brokerConn) cutShort(err error) error {
	if last := bc.lastFailure(); last != nil {
		return fmt.Errorf("%w (no answer yet to the dial under way: %v)", dialFailure(bc.broker, last), err)
	}
	return err
}

// lastFailure is what the last dial said when it failed, nil once one
// succeeded.
func (bc *brokerConn) lastFailure() error {
	if p := bc.lastErr.Load(); p != nil {
		return *p
	}
	return nil
}

// dialFailure is why broker b could not be used: the broker refusing
// access, which it says as such, or else unreachable.
func dialFailure(b *Broker, err error) error {
	if errors.Is(err, ErrBrokerAccessRefused) {
		return fmt.Errorf("%s: %w", b, err)
	}
	return fmt.Errorf("%w: %s: %v", ErrBrokerUnreachable, b, err)
}

// dial opens one connection, bounded by call_timeout and ctx, and prepares
// it with onDial. ctx's end closes the socket of a handshake under way: a
// broker that takes the TCP connection and never answers (stalled) holds
// a shutdown no longer than its deadline.
func (bc *brokerConn) dial(ctx context.Context) (*amqp.Connection, error) {
	timeout := bc.callTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = min(timeout, time.Until(dl))
	}
	if timeout <= 0 {
		return nil, context.DeadlineExceeded
	}
	dial := amqp.DefaultDial(timeout)
	stop := func() bool { return true }
	conn, err := amqp.DialConfig(bc.broker.URL, amqp.Config{
		Heartbeat: 10 * time.Second,
		Dial: func(network, addr string) (net.Conn, error) {
			raw, err := dial(network, addr)
			if err == nil {
				stop = context.AfterFunc(ctx, func() { raw.Close() })
			}
			return raw, err
		},
		Properties: amqp.Table{"connection_name": "switchyard"},
	})
	if !stop() && err == nil { // ctx ended as the handshake did: the socket is closed
		_ = conn.CloseDeadline(time.Now())
		err = ctx.Err()
	}
	if err != nil {
		return nil, bc.refusal("login", redactDialError(err))
	}
	if bc.onDial != nil {
		if err := bc.onDial(bc, conn); err != nil {
			_ = conn.CloseDeadline(time.Now().Add(time.Second))
			return nil, bc.refusal("declare", err)
		}
	}
	return conn, nil
}

// close closes the connection, if one is open, waiting within for the
// broker's close-ok; whatever is in flight fails. The next use dials anew.
func (bc *brokerConn) close(within time.Duration) error {
	bc.lock <- struct{}{}
	defer func() { <-bc.lock }()
	conn := bc.conn
	bc.conn = nil
	if conn == nil || conn.IsClosed() {
		bc.watchers.Wait()
		return nil
	}
	err := conn.CloseDeadline(time.Now().Add(within))
	bc.watchers.Wait() // amqp091-go closes their notifications with the connection
	if err != nil && !errors.Is(err, amqp.ErrClosed) {
		return fmt.Errorf("close %s: %w", bc.broker, err)
	}
	return nil
}

// errSevered is the answer to a use of a broker after sever.
var errSevered = errors.New("connection closed at shutdown")

// sever closes the connection at once, without waiting for the broker's
// close-ok, nor for lock: every call waiting on the broker fails now, the
// messages a consumer holds unacknowledged go back to their queue, and no
// connection is dialed after it. A shutdown out of time calls it.
func (bc *brokerConn) sever() {
	bc.severed.Store(true)
	if conn := bc.live.Load(); conn != nil {
		_ = conn.CloseDeadline(time.Now())
	}
}

// refusal is err, the broker's answer to op, as ErrBrokerAccessRefused
// when the broker refused the user (403 ACCESS_REFUSED, or 530
// NOT_ALLOWED for a vhost), with what the user lacks; any other err is
// returned as it is. op is "login", "declare", "publish", "consume" or
// "get": each needs its own right.
func (bc *brokerConn) refusal(op string, err error) error {
	var aerr *amqp.Error
	if !errors.As(err, &aerr) || (aerr.Code != amqp.AccessRefused && aerr.Code != amqp.NotAllowed) {
		return err
	}
	b := bc.broker
	var lacks string
	switch {
	case op == "login" && aerr.Code == amqp.NotAllowed, op == "login" && aerr.Reason == amqp.ErrVhost.Reason:
		lacks = fmt.Sprintf("vhost %q does not exist, or user %q has no permissions on it", b.Vhost, b.User)
	case op == "login":
		lacks = fmt.Sprintf("user %q was refused at login: a wrong password, or no such user", b.User)
	default:
		right := map[string]string{"declare": "configure", "publish": "write", "consume": "read", "get": "read"}[op]
		lacks = fmt.Sprintf("user %q lacks the %s permission in vhost %q (needed to %s)", b.User, right, b.Vhost, op)
	}
	return &BrokerRefusal{Kind: ErrBrokerAccessRefused, Reason: fmt.Sprintf("%s: %d %s", lacks, aerr.Code, aerr.Reason)}
}

// redactDialError keeps the error's meaning but never the URL (and so never
// the password) that some dial errors quote.
func redactDialError(err error) error {
	var aerr *amqp.Error
	var nerr net.Error
	switch {
	case errors.As(err, &aerr):
		return &amqp.Error{Code: aerr.Code, Reason: aerr.Reason, Server: aerr.Server, Recover: aerr.Recover}
	case errors.As(err, &nerr):
		return nerr
	default:
		return errors.New(err.Error())
	}
}

// call runs one blocking AMQP call on conn with call_timeout. amqp091-go's
// calls take no context, and a broker that stops answering would hold them
// forever (the heartbeat notices only after 30 s), so on timeout the
// connection is closed, which fails every call waiting on it; the next use
// dials anew.
func call[T any](bc *brokerConn, conn *amqp.Connection, what string, fn func() (T, error)) (T, error) {
	return callWithin(bc, conn, what, bc.callTimeout, fn)
}

// callWithin is call with a timeout of its own: a call that moves a large
// message takes longer than one that moves a method.
func callWithin[T any](bc *brokerConn, conn *amqp.Connection, what string, timeout time.Duration, fn func() (T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := fn()
		done <- result{v, err}
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case r := <-done:
		return r.v, r.err
	case <-t.C:
		go func() { _ = conn.CloseDeadline(time.Now().Add(time.Second)) }()
		var zero T
		return zero, fmt.Errorf("%s: %w after %s", what, ErrCallTimeout, timeout)
	}
}

// channel opens a channel on conn with call_timeout.
func (bc *brokerConn) channel(conn *amqp.Connection) (*amqp.Channel, error) {
	return call(bc, conn, "open channel", conn.Channel)
}

// openChannel opens a channel on the connection, dialing it if needed.
func (bc *brokerConn) openChannel(ctx context.Context) (*amqp.Connection, *amqp.Channel, error) {
	conn, err := bc.connection(ctx)
	if err != nil {
		return nil, nil, err
	}
	ch, err := bc.channel(conn)
	if err != nil {
		return nil, nil, err
	}
	return conn, ch, nil
}

// closeChannel closes ch without waiting on a broker that does not answer.
func (bc *brokerConn) closeChannel(conn *amqp.Connection, ch *amqp.Channel) {
	_, _ = call(bc, conn, "close channel", func() (struct{}, error) { return struct{}{}, ch.Close() })
}

// get is one basic_get with call_timeout; ok is false when the queue is
// empty. A basic.get-ok counts as a delivery.
func (bc *brokerConn) get(conn *amqp.Connection, ch *amqp.Channel, queue string) (amqp.Delivery, bool, error) {
	return bc.getWithin(conn, ch, queue, bc.callTimeout)
}

// getWithin is get, its call given timeout.
func (bc *brokerConn) getWithin(conn *amqp.Connection, ch *amqp.Channel, queue string, timeout time.Duration) (amqp.Delivery, bool, error) {
	type got struct {
		d  amqp.Delivery
		ok bool
	}
	g, err := callWithin(bc, conn, "get "+queue, timeout, func() (got, error) {
		d, ok, err := ch.Get(queue, false)
		return got{d, ok}, err
	})
	if g.ok {
		bc.delivered.Add(1)
	}
	return g.d, g.ok, bc.refusal("get", err)
}

// blockedState is a block the broker announced, or its refusal of a
// publish: which (ErrBrokerBlocked, ErrBrokerRefused or
// ErrBrokerAccessRefused), why, and since when.
type blockedState struct {
	Kind   error
	Reason string
	Since  time.Time
}

// cutBlock is a block that held when its connection closed, and when.
type cutBlock struct {
	blockedState
	at time.Time
}

// blockGap is how long after its connection closed a block is taken up by
// the next connection's: a dial (backoff at most a second) and the next
// publish (the outbox tries each second) fit in it many times over.
const blockGap = time.Minute

// isBlocked reports whether the broker blocks the connection now, or
// refuses publishes, and why.
func (bc *brokerConn) isBlocked() (blockedState, bool) {
	if st := bc.blocked.Load(); st != nil {
		return *st, true
	}
	if st := bc.refused.Load(); st != nil {
		return *st, true
	}
	return blockedState{}, false
}

// blockedError is the error of a publish the block refused.
func (bc *brokerConn) blockedError() error {
	st := blockedState{}
	if p := bc.blocked.Load(); p != nil {
		st = *p
	}
	return fmt.Errorf("%s: %w", bc.broker, &BrokerRefusal{Kind: ErrBrokerBlocked,
		Reason: cmp.Or(st.Reason, "blocked") + ", since " + st.Since.Format(time.RFC3339)})
}

// refuse records that the broker refused a publish (r): it counts as
// blocked from the first refusal until a publish is confirmed again.
func (bc *brokerConn) refuse(r *BrokerRefusal) {
	if bc.refused.CompareAndSwap(nil, &blockedState{Kind: r.Kind, Reason: r.Reason, Since: time.Now().UTC()}) {
		bc.log.Warn(r.Kind.Error()+": webhooks answer 503 until it confirms a publish again",
			"broker", bc.broker.String(), "reason", r.Reason)
		bc.metrics.brokerBlocked(bc.broker.Index, true)
	}
}

// confirmed records that the broker confirmed a publish: a refusal, if one
// held, is over.
func (bc *brokerConn) confirmed() {
	if bc.cut.Load() != nil {
		bc.cut.Store(nil)
	}
	if bc.refused.Load() == nil || bc.refused.Swap(nil) == nil {
		return
	}
	bc.log.Info("broker takes publishes again", "broker", bc.broker.String())
	bc.metrics.brokerBlocked(bc.broker.Index, bc.blocked.Load() != nil)
}

// watchBlocked follows the broker's connection.blocked and unblocked
// notifications for one connection until it closes (amqp091-go closes the
// channel then); a new connection starts unblocked, and a block it is
// told of within blockGap of a block cut by the last one's close goes on
// from that block's Since.
func (bc *brokerConn) watchBlocked(notes <-chan amqp.Blocking) {
	for n := range notes {
		if n.Active {
			st := &blockedState{Kind: ErrBrokerBlocked, Reason: cmp.Or(n.Reason, "no reason given"), Since: time.Now().UTC()}
			cut := bc.cut.Swap(nil)
			goesOn := cut != nil && cut.Reason == st.Reason && time.Since(cut.at) < blockGap
			if goesOn {
				st.Since = cut.Since
			}
			began := bc.blocked.Swap(st) == nil
			// The gauge before the signal: a webhook answered 503 for the
			// block finds it counted.
			bc.metrics.brokerBlocked(bc.broker.Index, true)
			if began {
				close(*bc.blockedSig.Load()) // publishes in flight give up now
			}
			if goesOn {
				bc.log.Info("broker still blocks publishing, on the new connection", "broker", bc.broker.String(), "reason", st.Reason,
					"since", st.Since.Format(time.RFC3339))
			} else {
				bc.log.Warn("broker blocks publishing: webhooks answer 503 until it unblocks", "broker", bc.broker.String(), "reason", st.Reason)
			}
		} else {
			bc.cut.Store(nil)
			bc.unblock()
			bc.metrics.brokerBlocked(bc.broker.Index, bc.refused.Load() != nil)
			bc.log.Info("broker unblocked publishing", "broker", bc.broker.String())
		}
	}
	if st := bc.blocked.Load(); st != nil {
		bc.cut.Store(&cutBlock{blockedState: *st, at: time.Now()})
	}
	if bc.unblock() {
		bc.metrics.brokerBlocked(bc.broker.Index, bc.refused.Load() != nil)
	}
}

// unblock ends a block, if one holds, with a fresh signal for the next; it
// reports whether one held.
func (bc *brokerConn) unblock() bool {
	if bc.blocked.Swap(nil) == nil {
		return false
	}
	sig := make(chan struct{})
	bc.blockedSig.Swap(&sig)
	return true
}
