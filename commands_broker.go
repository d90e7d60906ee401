// check-broker: whether one configured broker does what switchyard relies
// on, tried on the broker itself.

package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"text/tabwriter"
)

// checkBroker checks broker index (the active one's index is not known
// without the database, so 0 by default) and prints one line per check:
// ok, warn (differs, and switchyard copes) or FAIL with what differs, then
// the billable messages it spent. It fails (exit 1) when a check failed or
// the broker cannot be reached.
func checkBroker(ctx context.Context, cfg *Config, index int, log *slog.Logger, stdout io.Writer) error {
	if index < 0 || index >= len(cfg.Brokers) {
		return usagef("check-broker: -broker %d: want 0 to %d", index, len(cfg.Brokers)-1)
	}
	b, err := NewBroker(index, cfg.Brokers[index])
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "broker %s (queue.type %s, declare_topology %t)\n", b, cfg.Queue.Type, cfg.Queue.DeclareTopology)
	checks, spent, err := CheckBroker(ctx, b, cfg.Queue, log)
	if err != nil {
		return fmt.Errorf("check-broker: %w", err)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	failed := 0
	for _, c := range checks {
		verdict := "ok"
		switch {
		case !c.OK:
			verdict, failed = "FAIL", failed+1
		case c.Warn:
			verdict = "warn"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", verdict, c.Name, c.Detail)
	}
	tw.Flush()
	fmt.Fprintf(stdout, "spent %d billable messages (publishes and deliveries)\n", spent)
	if failed > 0 {
		return fmt.Errorf("broker %s does not fit: %d of %d checks failed", b, failed, len(checks))
	}
	fmt.Fprintln(stdout, "the broker fits")
	return nil
}
