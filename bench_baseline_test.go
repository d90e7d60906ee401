package main

// The bench's baselines: what the broker, the link and the database allow
// doing the same work without switchyard (the raw pipeline, the raw
// consumers, the raw open loop), each at the settings of the row it is the
// baseline of.

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// rawPipeline is what the broker and the link allow for the whole path,
// storing nothing: 64 goroutines publish the webhook's message through
// github-exchange with a confirm each over one amqps connection (as the
// daemon's webhook endpoint does), and one consumer on each of the fanout's
// two queues, on a connection of its own (as the daemon's workers share
// one), takes them with prefetch 200 and acks in batches of 100; for d, on
// the vhost behind the same proxy. packed publishes the payload
// zstd-compressed at the fastest level (content_encoding zstd), as the
// endpoint does. The rate is of messages both consumers acked, n how many;
// confirm is how long a publish waited for its confirm, on average.
func rawPipeline(b testing.TB, url string, payload []byte, packed bool, publishers int, d time.Duration) (rate float64, n int, confirm time.Duration) {
	body, encoding := payload, ""
	if packed {
		body, encoding = compressZstd(payload), encodingZstd
	}
	pub := dialRaw(b, url)
	defer pub.Close()
	cons := dialRaw(b, url)
	defer cons.Close()
	var acked [2]atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	rawConsumers(b, cons, &acked, stop, &wg)
	h := http.Header{}
	h.Set("X-GitHub-Event", "pull_request")
	h.Set("X-GitHub-Hook-Installation-Target-Type", "integration")
	var published, waited atomic.Int64
	deadline := time.Now().Add(d)
	start := time.Now()
	var pubs sync.WaitGroup
	for range publishers {
		ch, err := pub.Channel()
		if err != nil {
			b.Fatal(err)
		}
		_ = ch.Confirm(false)
		pubs.Go(func() {
			h := h.Clone()
			for time.Now().Before(deadline) {
				h.Set("X-GitHub-Delivery", fmt.Sprintf("raw-pipe-%d", published.Add(1)))
				msg := newPublishing(h, payload, "127.0.0.1", time.Now())
				msg.Body, msg.ContentEncoding = body, encoding
				sent := time.Now()
				dc, err := ch.PublishWithDeferredConfirm(exchangeName, "", true, false, msg)
				if err != nil || !dc.Wait() {
					b.Errorf("raw publish: %v", err)
					return
				}
				waited.Add(int64(time.Since(sent)))
			}
		})
	}
	pubs.Wait()
	total := published.Load() / 100 * 100
	eventually(b, 5*time.Minute, "the raw pipeline's consumers caught up", func() bool {
		return acked[0].Load() >= total && acked[1].Load() >= total
	})
	rate = float64(total) / time.Since(start).Seconds()
	// Every publish was confirmed, or the row failed.
	confirm = time.Duration(waited.Load() / max(published.Load(), 1))
	close(stop)
	wg.Wait()
	cons.Close() // what was not acked goes back, to be purged
	ch, err := pub.Channel()
	if err != nil {
		b.Fatal(err)
	}
	for _, q := range []string{queueGitHub, queueDatabase} {
		if _, err := ch.QueuePurge(q, false); err != nil {
			b.Fatal(err)
		}
	}
	return rate, int(total), confirm
}

// rawConsumers consume the fanout's two queues on cons, as the raw
// pipeline's (prefetch 200, acks in batches of 100, counted in acked),
// until stop is closed or cons closes; wg waits for them.
func rawConsumers(b testing.TB, cons *amqp.Connection, acked *[2]atomic.Int64, stop <-chan struct{}, wg *sync.WaitGroup) {
	for i, q := range []string{queueGitHub, queueDatabase} {
		ch, err := cons.Channel()
		if err != nil {
			b.Fatal(err)
		}
		_ = ch.Qos(200, 0, false)
		ds, err := ch.Consume(q, "", false, false, false, false, nil)
		if err != nil {
			b.Fatal(err)
		}
		wg.Go(func() {
			n := 0
			for {
				select {
				case <-stop:
					return
				case d, ok := <-ds:
					if !ok {
						return
					}
					if n++; n%100 == 0 {
						_ = d.Ack(true)
						acked[i].Add(100)
					}
				}
			}
		})
	}
}

// rawBatchedConsume is the baseline of a batched switchyard consumer: the
// same window (prefetch), the same batches (half a window, closed by the
// same batchWait), one transaction and one multiple ack per batch, a row per
// message holding value(d).
func rawBatchedConsume(b testing.TB, url, queue string, n, window int, db *sql.DB, value func(d *amqp.Delivery) []byte) float64 {
	conn, err := amqp.Dial(url)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ch, _ := conn.Channel()
	_ = ch.Qos(window, 0, false)
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	start := time.Now()
	for done := 0; done < n; {
		ds := []amqp.Delivery{<-deliveries}
		until := time.Now().Add(batchWindow)
		for len(ds) < max(1, window/2) && done+len(ds) < n {
			d, ok := receive(ctx, deliveries, batchWait(len(ds), until))
			if !ok {
				break
			}
			ds = append(ds, d)
		}
		tx, err := db.Begin()
		if err != nil {
			b.Fatal(err)
		}
		for i := range ds {
			if _, err := tx.Exec("INSERT INTO worker_deliveries (worker, delivery_id, processed_at) VALUES ('raw', $1, $2)",
				ds[i].MessageId, string(value(&ds[i]))); err != nil {
				b.Fatal(err)
			}
		}
		if err := tx.Commit(); err != nil {
			b.Fatal(err)
		}
		_ = ds[len(ds)-1].Ack(true)
		done += len(ds)
	}
	return float64(n) / time.Since(start).Seconds()
}

// rawInsert is the baseline's work per message: one row, one transaction,
// the same pragmas. value is what the row holds: a few bytes where
// switchyard writes a small typed row, the whole body where it stores the
// payload.
func rawInsert(b testing.TB, db *sql.DB, id string, value []byte) {
	tx, err := db.Begin()
	if err != nil {
		b.Fatal(err)
	}
	if _, err := tx.Exec("INSERT INTO worker_deliveries (worker, delivery_id, processed_at) VALUES ('raw', $1, $2)", id, string(value)); err != nil {
		b.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		b.Fatal(err)
	}
}

// rawOpenLoop is the raw pipeline of rawPipeline in an open loop: each
// webhook's message published through github-exchange as it is due, on
// one of 64 confirm channels of one amqps connection, answered when its
// confirm comes; a consumer on each of the fanout's queues (prefetch 200,
// acks in batches of 100) takes them, which is the end of its path.
func rawOpenLoop(b testing.TB, url string, payload []byte) (held, broke openLoopStep) {
	pub := dialRaw(b, url)
	defer pub.Close()
	cons := dialRaw(b, url)
	var acked [2]atomic.Int64
	stop := make(chan struct{})
	var consumers sync.WaitGroup
	rawConsumers(b, cons, &acked, stop, &consumers)
	defer consumers.Wait()
	defer close(stop)
	defer cons.Close()
	chans := make([]*amqp.Channel, 64)
	for i := range chans {
		var err error
		if chans[i], err = pub.Channel(); err != nil {
			b.Fatal(err)
		}
		_ = chans[i].Confirm(false)
	}
	h := http.Header{}
	h.Set("X-GitHub-Event", "pull_request")
	h.Set("X-GitHub-Hook-Installation-Target-Type", "integration")
	// The consumers count in hundreds: within a hundred of what was sent
	// is through.
	taken := func() int { return int(min(acked[0].Load(), acked[1].Load())) + 99 }
	return sustainedOpenLoop(100, func(i int) error {
		h := h.Clone()
		h.Set("X-GitHub-Delivery", fmt.Sprintf("raw-open-%d", i))
		msg := newPublishing(h, payload, "127.0.0.1", time.Now())
		dc, err := chans[i%len(chans)].PublishWithDeferredConfirm(exchangeName, "", true, false, msg)
		if err != nil {
			return err
		}
		if !dc.Wait() {
			return fmt.Errorf("nacked")
		}
		return nil
	}, taken)
}

// dialRaw is a baseline's connection to url.
func dialRaw(b testing.TB, url string) *amqp.Connection {
	b.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		b.Fatal(err)
	}
	return conn
}
