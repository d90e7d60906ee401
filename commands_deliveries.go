// deliveries show: one delivery's story from the database and the -error
// queues.

package main

import (
	"cmp"
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
		if b, err := ParseBroker(i, bc.URL); err == nil {
			brokers = append(brokers, b)
		}
	}
	q := operatorQueues(cfg, brokers, slog.New(slog.DiscardHandler))
	defer q.Close()
	defer func() { _ = WriteUsage(context.WithoutCancel(ctx), store, q, time.Now()) }()
	var out []StoryError
	for _, b := range brokers {
		for _, queue := range logicalQueues {
			_, _ = q.PeekErrors(ctx, b, queue, errorPeekLimit, func(d *amqp.Delivery) {
				if isDelivery(d, guid) {
					out = append(out, StoryError{Broker: b.Index, Queue: errorQueue(queue), Reason: tableString(d.Headers, hdrErrorReason),
						Attempts: tableString(d.Headers, hdrErrorAttempts)})
				}
			})
			_, _ = q.PeekRetries(ctx, b, queue, errorPeekLimit, func(d *amqp.Delivery, failures int64) {
				if isDelivery(d, guid) {
					out = append(out, StoryError{Broker: b.Index, Queue: retryQueue(queue), Reason: reasonRetrying,
						Attempts: strconv.FormatInt(failures, 10)})
				}
			})
		}
	}
	return out
}

// showDelivery prints everything the database knows of one delivery:
// when it was accepted and stored, what each worker made of it, the typed
// rows it wrote, its redelivery, its gap, its alerts, and whether its
// payload was pruned. An unknown GUID is an error (exit 1).
func showDelivery(ctx context.Context, cfg *Config, guid string, payload, asJSON bool, stdout io.Writer) error {
	store, err := openExisting(ctx, cfg.Database)
	if err != nil {
		return err
	}
	defer store.Close()
	st, err := store.Story(ctx, guid)
	waiting := errorWaits(ctx, cfg, store, guid)
	if errors.Is(err, ErrUnknownDelivery) && len(waiting) > 0 {
		st, err = &DeliveryStory{GUID: guid, GitHub: []StoryAttempt{}, Workers: []StoryWorker{}, Rows: []StoryRow{}, Alerts: []StoryAlert{}}, nil
	}
	if err != nil {
		return err
	}
	st.Errors = waiting
	if asJSON {
		out := struct {
			*DeliveryStory
			Payload *json.RawMessage `json:"payload,omitempty"`
		}{DeliveryStory: st}
		if payload && json.Valid([]byte(st.Payload)) {
			raw := json.RawMessage(st.Payload)
			out.Payload = &raw
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(out)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	defer tw.Flush()
	when := func(t time.Time) string { return t.UTC().Format(time.RFC3339) }
	fmt.Fprintf(tw, "delivery\t%s\n", guid)
	for _, a := range st.GitHub {
		fmt.Fprintf(tw, "github attempt\t%s\n", attemptLine(a))
	}
	if r := st.Received; r != nil {
		what := r.Event
		if r.Action != "" {
			what += "." + r.Action
		}
		fmt.Fprintf(tw, "event\t%s on %s by %s\n", what, cmp.Or(r.Repository, "-"), cmp.Or(r.Sender, "-"))
		fmt.Fprintf(tw, "accepted\t%s from %s%s\n", when(r.ReceivedAt), cmp.Or(r.SourceIP, "-"),
			map[bool]string{true: " (outside the allowed sources: github-forbidden)", false: ""}[r.Forbidden])
		if r.Broker != "" {
			fmt.Fprintf(tw, "broker\tcame through %s\n", r.Broker)
		}
		if r.TargetType != "" {
			fmt.Fprintf(tw, "hook\t%s %d\n", r.TargetType, r.TargetID)
		}
		fmt.Fprintf(tw, "stored\t%s\n", when(r.StoredAt))
		if r.Duplicates > 0 && r.LastDuplicateAt != nil {
			fmt.Fprintf(tw, "duplicate\treceived again %s after it was stored, the last %s; each changed nothing\n",
				plural(r.Duplicates, "time"), when(*r.LastDuplicateAt))
		}
		if r.PrunedAt != nil {
			fmt.Fprintf(tw, "payload\tpruned %s (database.raw_retention); the row stays as the delivery's identity\n", when(*r.PrunedAt))
		} else {
			fmt.Fprintf(tw, "payload\t%d bytes\n", r.PayloadBytes)
		}
	} else {
		fmt.Fprintf(tw, "stored\tnot in github\n")
	}
	for _, w := range st.Workers {
		outcome := w.Outcome
		if outcome == "stale" {
			outcome = "stale: the typed row held a newer object and was kept"
		}
		fmt.Fprintf(tw, "worker %s\t%s %s\n", w.Worker, outcome, when(w.At))
	}
	for _, r := range st.Rows {
		fmt.Fprintf(tw, "typed row\t%s %s\n", r.Table, r.Key)
	}
	if h := st.Hooks; h != nil {
		line := "queued on github-hooks " + when(h.QueuedAt)
		if h.RepublishedAt != nil {
			line += ", republished " + when(*h.RepublishedAt)
		}
		fmt.Fprintf(tw, "redelivery\t%s\n", line)
	}
	if g := st.Gap; g != nil {
		state := "open"
		switch {
		case g.UnrecoverableAt != nil:
			state = "unrecoverable: " + g.LastError
		case g.RedeliveredAt != nil:
			state = "open, redelivery asked " + when(*g.RedeliveredAt)
		}
		fmt.Fprintf(tw, "gap\tfound %s, GitHub delivered it %s; %s\n", when(g.FoundAt), when(g.DeliveredAt), state)
	}
	for _, e := range st.Errors {
		fmt.Fprintf(tw, "in %s\t%s on broker #%d: %s (attempts %s)\n", e.Queue, e.Queue, e.Broker, e.Reason, cmp.Or(e.Attempts, "-"))
	}
	for _, a := range st.Alerts {
		state := "waiting"
		if a.SentAt != nil {
			state = "sent " + when(*a.SentAt)
		} else if a.LastError != "" {
			state = "not sent yet: " + a.LastError
		}
		fmt.Fprintf(tw, "alert %s\t%s\n", a.Channel, state)
	}
	if payload && st.Payload != "" {
		tw.Flush()
		fmt.Fprintf(stdout, "\n%s\n", st.Payload)
	}
	return nil
}

// attemptLine tells one of GitHub's attempts: when, the status code and
// status GitHub recorded, and whether it was a redelivery.
func attemptLine(a StoryAttempt) string {
	line := fmt.Sprintf("%s %d %s", a.DeliveredAt.UTC().Format(time.RFC3339), a.StatusCode, a.Status)
	if a.Redelivery {
		line += " (redelivery)"
	}
	return line
}
