// deliveries show: one delivery's story from the database and the -error
// queues.

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// reasonRetrying is what a story says of a delivery waiting in a -retry
// queue: the broker keeps no reason for a nack, the log does.
const reasonRetrying = "failed for a passing reason and tries again after queue.retry_ttl (the log has each failure's reason)"

// errorPeekLimit bounds the messages `deliveries show` looks at in each
// -error queue: each look is a delivery a plan's quota counts.
const errorPeekLimit = 1000

// errorWaits finds delivery guid's messages in the -error and -retry queues
// of every broker, with why they are there; they stay where they are. A broker that
// does not answer is left out. Each message looked at is a basic.get-ok a
// plan counts: they are added to store's broker_usage.
func errorWaits(ctx context.Context, cfg *Config, store *Store, guid string) []StoryError {
	var brokers []*Broker
	for i, bc := range cfg.Brokers {
		if b, err := NewBroker(i, bc); err == nil {
			brokers = append(brokers, b)
		}
	}
	q := operatorQueues(cfg, brokers, slog.New(slog.DiscardHandler))
	defer q.Close()
	defer func() { _ = WriteUsage(context.WithoutCancel(ctx), store, q, time.Now()) }()
	hook := func(d *amqp.Delivery) int64 {
		id, _ := parseHookID(tableString(d.Headers, hdrHookID))
		return id
	}
	var out []StoryError
	for _, b := range brokers {
		for _, queue := range logicalQueues {
			_, _ = q.PeekErrors(ctx, b, queue, errorPeekLimit, func(d *amqp.Delivery) {
				if isDelivery(d, guid) {
					out = append(out, StoryError{Broker: b.Index, Queue: errorQueue(queue), Hook: hook(d),
						Reason: tableString(d.Headers, hdrErrorReason), Attempts: tableString(d.Headers, hdrErrorAttempts)})
				}
			})
			_, _ = q.PeekRetries(ctx, b, queue, errorPeekLimit, func(d *amqp.Delivery, failures int64) {
				if isDelivery(d, guid) {
					out = append(out, StoryError{Broker: b.Index, Queue: retryQueue(queue), Hook: hook(d), Reason: reasonRetrying,
						Attempts: strconv.FormatInt(failures, 10)})
				}
			})
		}
	}
	return out
}

// showDelivery prints everything the database knows of one event's
// deliveries, every hook's copy or, with hook at 0 or more, that hook's
// only (StoryLine tells how), and its messages waiting in -error and
// -retry queues. An unknown GUID is an error (exit 1).
func showDelivery(ctx context.Context, cfg *Config, guid string, hook int64, payload, asJSON bool, stdout io.Writer) error {
	store, err := openExisting(ctx, cfg.Database)
	if err != nil {
		return err
	}
	defer store.Close()
	st, err := store.Story(ctx, guid)
	if err == nil {
		st.LinkTraces(cfg.Tracing.UIURL)
	}
	waiting := errorWaits(ctx, cfg, store, guid)
	if errors.Is(err, ErrUnknownDelivery) && len(waiting) > 0 {
		st, err = newStory(guid), nil
		for _, e := range waiting {
			st.copyOf(e.Hook)
		}
	}
	if err != nil {
		return err
	}
	st.Errors = waiting
	if hook >= 0 {
		if err := st.Narrow(hook); err != nil {
			return err
		}
	}
	if asJSON {
		out := struct {
			*DeliveryStory
			Payload *json.RawMessage `json:"payload,omitempty"`
		}{DeliveryStory: st}
		if p := st.Payload(); payload && json.Valid([]byte(p)) {
			raw := json.RawMessage(p)
			out.Payload = &raw
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(out)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	for _, l := range st.Lines() {
		fmt.Fprintf(tw, "%s\t%s\n", l.Label, l.Text)
	}
	tw.Flush()
	if p := st.Payload(); payload && p != "" {
		fmt.Fprintf(stdout, "\n%s\n", p)
	}
	return nil
}
