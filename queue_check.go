package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// What switchyard relies on a broker for, checked on a real one: the
// check-broker command. Brokers differ exactly there (RabbitMQ 3.13.0-3.13.2
// could drop a message in the nack -> TTL -> back cycle, LavinMQ below 1.2.5
// brought a retry back at once and up to 2.6.1 split x-death entries,
// RabbitMQ 4 caps messages at 16 MiB), so it is better tried than assumed.

// BrokerCheck is one line of check-broker: what was checked and what it
// found. A check that Warns differs from RabbitMQ, but switchyard copes.
type BrokerCheck struct {
	Name   string
	OK     bool
	Warn   bool
	Detail string
}

// checkCycleTTL is the TTL of the check's own retry queue: long enough to
// tell a message that waited it from one that came back at once.
const checkCycleTTL = 500 * time.Millisecond

// checkLargeBody is the size, before compression, of the check's large
// message: a large GitHub payload.
const checkLargeBody = 20 << 20

// brokerCheck runs the checks on one connection; spent counts the
// billable messages (publishes, basic.deliver, basic.get-ok).
type brokerCheck struct {
	bc   *brokerConn
	conn *amqp.Connection
	ch   *amqp.Channel
	// closes tells why the broker closed ch: a 403 is a permission the
	// user lacks, which the check names.
	closes chan *amqp.Error
	// connCloses tells that the connection closed.
	connCloses chan *amqp.Error
	cfg        QueueConfig
	prefix     string
	spent      int64
	checks     []BrokerCheck
}

// CheckBroker checks broker b for what switchyard relies on, with queues of
// its own that it deletes afterwards, and the topology cfg describes. It
// returns one BrokerCheck per check and the billable messages it spent; an
// error only when the broker cannot be reached at all.
func CheckBroker(ctx context.Context, b *Broker, cfg QueueConfig, log *slog.Logger) ([]BrokerCheck, int64, error) {
	bc := newBrokerConn(b, cfg.CallTimeout, nil, nil, log)
	defer bc.close(bc.callTimeout)
	conn, err := bc.connection(ctx)
	if err != nil {
		return nil, 0, err
	}
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	c := &brokerCheck{bc: bc, conn: conn, cfg: cfg, prefix: "switchyard-check-" + hex.EncodeToString(suffix),
		connCloses: conn.NotifyClose(make(chan *amqp.Error, 1))}
	defer c.cleanup()

	c.blockedAdvertised()
	if err := c.open(); err != nil {
		c.add("publisher confirms", false, "no confirm channel: %v", err)
		return c.checks, c.spent, nil
	}
	c.add("publisher confirms", true, "confirm.select taken")
	c.unroutable()
	c.fanout()
	c.retryCycle()
	c.topology()
	// Last: a broker whose message size limit is below it may drop the
	// whole connection, and every check after it would read as unreachable.
	c.large(b.MaxMessageBytes)
	return c.checks, c.spent, nil
}

func (c *brokerCheck) add(name string, ok bool, format string, args ...any) {
	c.checks = append(c.checks, BrokerCheck{Name: name, OK: ok, Detail: fmt.Sprintf(format, args...)})
}

// open (re)opens the check's confirm channel; a failed check may have
// closed it.
func (c *brokerCheck) open() error {
	if c.ch != nil && !c.ch.IsClosed() {
		return nil
	}
	ch, err := c.bc.channel(c.conn)
	if err != nil {
		return err
	}
	if _, err := call(c.bc, c.conn, "confirm select", func() (struct{}, error) { return struct{}{}, ch.Confirm(false) }); err != nil {
		return err
	}
	c.ch, c.closes = ch, ch.NotifyClose(make(chan *amqp.Error, 1))
	return nil
}

// dropped reports whether the connection closed, waiting a moment for
// amqp091-go to notice: a write that failed goes before it.
func (c *brokerCheck) dropped() bool {
	select {
	case <-c.connCloses:
		return true
	case <-time.After(time.Second):
		return c.conn.IsClosed()
	}
}

// closedBy is why the broker closed the check's channel, as the user's
// missing permission when it was one (brokerConn.refusal); nil when it
// did not say.
func (c *brokerCheck) closedBy(op string) error {
	select {
	case e := <-c.closes:
		if e != nil {
			return c.bc.refusal(op, e)
		}
	case <-time.After(100 * time.Millisecond):
	}
	return nil
}

// publish sends msg and waits for its confirm; returned reports a
// basic.return before it.
func (c *brokerCheck) publish(exchange, key string, msg amqp.Publishing) (returned bool, err error) {
	if err := c.open(); err != nil {
		return false, err
	}
	returns := c.ch.NotifyReturn(make(chan amqp.Return, 1))
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.PublishTimeout)
	defer cancel()
	dc, err := c.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	if err != nil {
		return false, err
	}
	c.spent++
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		return false, fmt.Errorf("no confirm within queue.publish_timeout: %w", err)
	}
	if !acked {
		if c.conn.IsClosed() {
			return false, fmt.Errorf("%w: the broker dropped the connection on a message of %d bytes", ErrBrokerUnreachable, len(msg.Body))
		}
		if c.ch.IsClosed() {
			if err := c.closedBy("publish"); err != nil {
				return false, fmt.Errorf("the broker closed the channel: %w", err)
			}
		}
		return false, errors.New("the broker nacked the publish")
	}
	select {
	case <-returns:
		return true, nil
	default:
		return false, nil
	}
}

// declare declares one of the check's own queues.
func (c *brokerCheck) declare(name string, args amqp.Table) error {
	if err := c.open(); err != nil {
		return err
	}
	full := amqp.Table{"x-queue-type": queueType(c.cfg)}
	for k, v := range args {
		full[k] = v
	}
	_, err := call(c.bc, c.conn, "declare "+name, func() (amqp.Queue, error) {
		return c.ch.QueueDeclare(name, true, false, false, false, full)
	})
	return c.bc.refusal("declare", err)
}

// get takes one message of queue, waiting up to within for one to come.
func (c *brokerCheck) get(queue string, within time.Duration) (amqp.Delivery, bool, error) {
	deadline := time.Now().Add(within)
	for {
		if err := c.open(); err != nil {
			return amqp.Delivery{}, false, err
		}
		d, ok, err := c.bc.getWithin(c.conn, c.ch, queue, max(c.bc.callTimeout, within))
		if ok {
			c.spent++
		}
		if err != nil || ok || time.Now().After(deadline) {
			return d, ok, err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// blockedAdvertised: connection.blocked among the server's capabilities.
// LavinMQ does not send it; switchyard then sees a refusal instead.
func (c *brokerCheck) blockedAdvertised() {
	caps, _ := c.conn.Properties["capabilities"].(amqp.Table)
	if on, _ := caps["connection.blocked"].(bool); on {
		c.add("connection.blocked advertised", true, "a resource alarm blocks the connection and says why")
		return
	}
	c.checks = append(c.checks, BrokerCheck{Name: "connection.blocked advertised", OK: true, Warn: true,
		Detail: "not advertised: a broker short of resources shows as refusing publishes instead"})
}

// unroutable: a mandatory publish that no queue takes comes back.
func (c *brokerCheck) unroutable() {
	returned, err := c.publish("", c.prefix+"-nowhere", amqp.Publishing{Body: []byte("{}"), MessageId: "check-unroutable"})
	switch {
	case err != nil:
		c.add("mandatory publish, no route", false, "%v", err)
	case !returned:
		c.add("mandatory publish, no route", false, "not returned: a publish to a deleted queue would look delivered")
	default:
		c.add("mandatory publish, no route", true, "returned before its confirm")
	}
}

// fanout: a fanout exchange puts one publish in two queues, which passive
// declares count and basic.get takes.
func (c *brokerCheck) fanout() {
	ex, q1, q2 := c.prefix+"-fanout", c.prefix+"-a", c.prefix+"-b"
	err := c.open()
	if err == nil {
		_, err = call(c.bc, c.conn, "declare exchange", func() (struct{}, error) {
			return struct{}{}, c.ch.ExchangeDeclare(ex, amqp.ExchangeFanout, false, true, false, false, nil)
		})
	}
	for _, q := range []string{q1, q2} {
		if err == nil {
			err = c.declare(q, nil)
		}
		if err == nil {
			_, err = call(c.bc, c.conn, "bind", func() (struct{}, error) { return struct{}{}, c.ch.QueueBind(q, "", ex, false, nil) })
		}
	}
	if err == nil {
		_, err = c.publish(ex, "", amqp.Publishing{Body: []byte(`{"check":"fanout"}`), MessageId: "check-fanout", DeliveryMode: amqp.Persistent})
	}
	if err != nil {
		c.add("fanout to two queues", false, "%v", err)
		return
	}
	c.add("fanout to two queues", true, "one publish, confirmed")
	counts, cerr := c.bc.readyCounts(context.Background(), []string{q1, q2})
	if cerr != nil || counts[q1] != 1 || counts[q2] != 1 {
		c.add("passive declare counts", false, "counted %d and %d (%v), want 1 and 1", counts[q1], counts[q2], cerr)
	} else {
		c.add("passive declare counts", true, "1 and 1")
	}
	for _, q := range []string{q1, q2} {
		d, ok, err := c.get(q, time.Second)
		if err != nil || !ok || string(d.Body) != `{"check":"fanout"}` {
			c.add("basic.get", false, "%s: got %v, %v", q, ok, err)
			return
		}
		_ = d.Ack(false)
	}
	c.add("basic.get", true, "took the message from both queues")
}

// retryCycle: nack without requeue sends a message through the retry
// queue's TTL and back, waiting the TTL, and x-death counts each nack.
func (c *brokerCheck) retryCycle() {
	const name = "nack -> -retry -> back"
	main, retry := c.prefix+"-cycle", c.prefix+"-cycle-retry"
	err := c.declare(main, amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": retry})
	if err == nil {
		err = c.declare(retry, amqp.Table{"x-message-ttl": checkCycleTTL.Milliseconds(),
			"x-dead-letter-exchange": "", "x-dead-letter-routing-key": main})
	}
	if err == nil {
		_, err = c.publish("", main, amqp.Publishing{Body: []byte(`{"check":"cycle"}`), MessageId: "check-cycle", DeliveryMode: amqp.Persistent})
	}
	if err != nil {
		c.add(name, false, "%v", err)
		return
	}
	var nacked time.Time
	for cycle := int64(0); cycle <= 2; cycle++ {
		d, ok, err := c.get(main, 10*checkCycleTTL)
		if err != nil || !ok {
			c.add(name, false, "cycle %d: the message did not come back within %s (%v): a retried message would be lost", cycle, 10*checkCycleTTL, err)
			return
		}
		if waited := time.Since(nacked); cycle > 0 && waited < checkCycleTTL*9/10 {
			c.add(name, false, "cycle %d: back after %s, before the TTL of %s: retries would not wait retry_ttl", cycle, waited.Round(time.Millisecond), checkCycleTTL)
			_ = d.Ack(false)
			return
		}
		count, ok := deathCount(d.Headers, main)
		if !ok || count != cycle {
			c.add(name, false, "cycle %d: attempt count %d (x-death %v), want %d", cycle, count, d.Headers["x-death"], cycle)
			_ = d.Ack(false)
			return
		}
		if cycle == 2 {
			_ = d.Ack(false)
			break
		}
		if err := d.Nack(false, false); err != nil {
			c.add(name, false, "nack: %v", err)
			return
		}
		nacked = time.Now()
	}
	c.add(name, true, "came back twice after the TTL of %s, attempt count 1 then 2", checkCycleTTL)
}

// large: a 20 MiB body travels compressed as the daemon publishes it (zstd,
// or gzip with queue.compress = "none"), within the broker's
// max_message_bytes, and reads back whole.
func (c *brokerCheck) large(maxBytes int64) {
	const name = "compressed message, 20 MiB before compression"
	q := c.prefix + "-large"
	body := make([]byte, 0, checkLargeBody)
	body = append(body, `{"check":"large","body":"`...)
	line := make([]byte, 4096)
	for len(body) < checkLargeBody-64 {
		_, _ = rand.Read(line[:1024])
		body = hex.AppendEncode(body, line[:1024])
	}
	body = append(body, `"}`...)
	packed, encoding := compressZstd(body), encodingZstd
	if c.cfg.Compress != encodingZstd {
		packed, encoding = compressGzip(body), encodingGzip
	}
	if maxBytes > 0 && int64(len(packed)) > maxBytes {
		c.add(name, false, "%d bytes compressed, over max_message_bytes (%d)", len(packed), maxBytes)
		return
	}
	err := c.declare(q, nil)
	if err == nil {
		_, err = c.publish("", q, amqp.Publishing{Body: packed, ContentEncoding: encoding, MessageId: "check-large", DeliveryMode: amqp.Persistent})
	}
	if err != nil && c.dropped() {
		c.add(name, false, "%d bytes compressed: the broker dropped the connection on it: its message size limit is below that; "+
			"set brokers[%d].max_message_bytes under the limit so that switchyard answers 413 instead (%v)", len(packed), c.bc.broker.Index, err)
		return
	}
	if err != nil {
		c.add(name, false, "%d bytes compressed: %v", len(packed), err)
		return
	}
	// The message is confirmed, so in the queue; a get of ten megabytes
	// across a distant, slow or loaded link takes what it takes: the check
	// waits as long as any AMQP call may (call_timeout), and the time the
	// message takes at 1 MiB/s (a slow link's rate, or a loaded broker's),
	// not a fixed time that a slow link outlasts.
	within := c.bc.callTimeout + time.Duration(len(packed))*time.Second/(1<<20)
	d, ok, err := c.get(q, within)
	if err != nil || !ok {
		c.add(name, false, "not taken back within %s: %v", within, err)
		return
	}
	_ = d.Ack(false)
	got, err := inflateBody(d.ContentEncoding, d.Body)
	if err != nil || !bytes.Equal(got, body) {
		c.add(name, false, "read back %d bytes (%v), want %d", len(got), err, len(body))
		return
	}
	c.add(name, true, "%d bytes as %d compressed (%s), read back whole", len(body), len(packed), encoding)
}

// topology: the 12 queues exist with the arguments switchyard declares
// (declared here when queue.declare_topology is on). An existing queue is
// declared again with the expected arguments, which changes nothing and
// fails (406) where they differ: a -retry queue without its TTL would
// hold a failed message for ever.
func (c *brokerCheck) topology() {
	const name = "topology"
	_, missing, err := c.bc.inspect(context.Background(), allQueues())
	if err != nil {
		c.add(name, false, "%v", err)
		return
	}
	if len(missing) > 0 && !c.cfg.DeclareTopology {
		c.add(name, false, "missing %v (queue.declare_topology is off: provision them as docs/brokers.md says)", missing)
		return
	}
	if c.cfg.DeclareTopology {
		if err := declareTopology(c.cfg)(c.bc, c.conn); err != nil {
			c.add(name, false, "%v", err)
			return
		}
		c.add(name, true, "exchange, 12 queues and bindings declared")
		return
	}
	for _, q := range allQueues() {
		if err := c.open(); err != nil {
			c.add(name, false, "%v", err)
			return
		}
		_, err := call(c.bc, c.conn, "declare "+q, func() (amqp.Queue, error) {
			return c.ch.QueueDeclare(q, true, false, false, false, queueArgs(c.cfg, q))
		})
		if err = c.bc.refusal("declare", err); errors.Is(err, ErrBrokerAccessRefused) {
			// A provisioned broker's user needs no configure permission
			// at run time: present is what can be checked.
			c.checks = append(c.checks, BrokerCheck{Name: name, OK: true, Warn: true,
				Detail: fmt.Sprintf("the 12 queues are present; their arguments not compared: %v", err)})
			return
		}
		if err != nil {
			// Brokers word a 406 each their own way (RabbitMQ names the
			// argument, LavinMQ does not): what switchyard declares is
			// said here.
			c.add(name, false, "%s differs from what switchyard declares (%s): %v", q, argsText(queueArgs(c.cfg, q)), err)
			return
		}
	}
	c.add(name, true, "the 12 queues are present with the arguments switchyard declares")
}

// argsText is a queue's arguments as key=value, in key order.
func argsText(args amqp.Table) string {
	var kv []string
	for _, k := range slices.Sorted(maps.Keys(args)) {
		kv = append(kv, fmt.Sprintf("%s=%v", k, args[k]))
	}
	return strings.Join(kv, " ")
}

// cleanup deletes the check's own queues and exchange, on a connection
// dialed again when the broker dropped the check's.
func (c *brokerCheck) cleanup() {
	ctx, cancel := context.WithTimeout(context.Background(), c.bc.callTimeout)
	defer cancel()
	conn, ch, err := c.bc.openChannel(ctx)
	if err != nil {
		return
	}
	defer c.bc.closeChannel(conn, ch)
	for _, q := range []string{"-a", "-b", "-cycle", "-cycle-retry", "-large"} {
		_, _ = call(c.bc, conn, "delete", func() (int, error) { return ch.QueueDelete(c.prefix+q, false, false, false) })
	}
	_, _ = call(c.bc, conn, "delete exchange", func() (struct{}, error) {
		return struct{}{}, ch.ExchangeDelete(c.prefix+"-fanout", false, false)
	})
}
