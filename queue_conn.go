package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The connections: one per broker, shared by the webhook endpoint
// and every worker, dialed on demand with backoff and jitter; channels per
// use; every AMQP call bounded by call_timeout.

// conn returns the live connection to broker b, dialing it when there is none
// and the backoff since the last failure has passed. Within the backoff it
// fails at once, so a dead broker costs callers nothing.
func (q *Queues) conn(ctx context.Context, b *Broker) (*amqp.Connection, *publisher, error) {
	bc := q.conns[b.Index]
	select {
	case bc.lock <- struct{}{}:
	case <-ctx.Done():
		return nil, nil, ctx.Err()
	}
	defer func() { <-bc.lock }()

	if bc.conn != nil && !bc.conn.IsClosed() {
		return bc.conn, bc.pub, nil
	}
	if now := time.Now(); now.Before(bc.retryAt) {
		return nil, nil, fmt.Errorf("%w: %s: %v (next try in %s)", ErrBrokerUnreachable, b, bc.lastErr, bc.retryAt.Sub(now).Round(time.Millisecond))
	}
	conn, err := q.dial(ctx, b)
	if err != nil {
		bc.failures++
		backoff := min(q.minBackoff<<min(bc.failures-1, 16), q.maxBackoff)
		backoff = backoff/2 + rand.N(backoff/2+1) // jitter: brokers restarting see no thundering herd
		bc.retryAt, bc.lastErr = time.Now().Add(backoff), err
		return nil, nil, fmt.Errorf("%w: %s: %v", ErrBrokerUnreachable, b, err)
	}
	if bc.failures > 0 {
		q.log.Info("broker reachable again", "broker", b.String(), "after_failures", bc.failures)
	}
	bc.conn, bc.pub, bc.failures, bc.lastErr = conn, newPublisher(conn, q), 0, nil
	go q.watchBlocked(bc, conn.NotifyBlocked(make(chan amqp.Blocking, 4)))
	return conn, bc.pub, nil
}

// dial opens one connection, bounded by call_timeout and ctx, and declares the
// topology on it when configured to.
func (q *Queues) dial(ctx context.Context, b *Broker) (*amqp.Connection, error) {
	timeout := q.cfg.CallTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = min(timeout, time.Until(dl))
	}
	if timeout <= 0 {
		return nil, context.DeadlineExceeded
	}
	conn, err := amqp.DialConfig(b.URL, amqp.Config{
		Heartbeat:  10 * time.Second,
		Dial:       amqp.DefaultDial(timeout),
		Properties: amqp.Table{"connection_name": "switchyard"},
	})
	if err != nil {
		return nil, redactDialError(err)
	}
	if q.cfg.DeclareTopology {
		if err := q.declareTopology(conn); err != nil {
			_ = conn.CloseDeadline(time.Now().Add(time.Second))
			return nil, fmt.Errorf("declare topology: %w", err)
		}
	}
	return conn, nil
}

// redactDialError keeps the error's meaning but never the URL (and so never
// the password) that some dial errors quote.
func redactDialError(err error) error {
	var aerr *amqp.Error
	var nerr net.Error
	switch {
	case errors.As(err, &aerr):
		return fmt.Errorf("%s (code %d)", aerr.Reason, aerr.Code)
	case errors.As(err, &nerr):
		return nerr
	default:
		return errors.New(err.Error())
	}
}

// call runs one blocking AMQP call with call_timeout. amqp091-go's calls take
// no context, and a broker that stops answering would hold them forever (the
// heartbeat notices only after 30 s), so on timeout the connection is closed,
// which fails every call waiting on it; the next use dials anew.
func call[T any](q *Queues, conn *amqp.Connection, what string, fn func() (T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := fn()
		done <- result{v, err}
	}()
	t := time.NewTimer(q.cfg.CallTimeout)
	defer t.Stop()
	select {
	case r := <-done:
		return r.v, r.err
	case <-t.C:
		go func() { _ = conn.CloseDeadline(time.Now().Add(time.Second)) }()
		var zero T
		return zero, fmt.Errorf("%s: %w after %s", what, ErrCallTimeout, q.cfg.CallTimeout)
	}
}

// channel opens a channel on conn with call_timeout.
func (q *Queues) channel(conn *amqp.Connection) (*amqp.Channel, error) {
	return call(q, conn, "open channel", conn.Channel)
}

// openChannel opens a channel on broker b's connection, dialing it if needed.
func (q *Queues) openChannel(ctx context.Context, b *Broker) (*amqp.Connection, *amqp.Channel, error) {
	conn, _, err := q.conn(ctx, b)
	if err != nil {
		return nil, nil, err
	}
	ch, err := q.channel(conn)
	if err != nil {
		return nil, nil, err
	}
	return conn, ch, nil
}

// closeChannel closes ch without waiting on a broker that does not answer.
func (q *Queues) closeChannel(conn *amqp.Connection, ch *amqp.Channel) {
	_, _ = call(q, conn, "close channel", func() (struct{}, error) { return struct{}{}, ch.Close() })
}
