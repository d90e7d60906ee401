// reprocess: the typed tables derived again from the raw log.

package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"text/tabwriter"
	"time"
)

// ReprocessFlags are reprocess's flags.
type ReprocessFlags struct {
	Since  time.Duration // 0: the whole raw log
	Event  string
	DryRun bool
}

// reprocess runs Reprocess over the configured database, beside serve or
// without it, with progress on a terminal, and prints what it did and what
// it skipped, and why.
func reprocess(ctx context.Context, cfg *Config, f ReprocessFlags, log *slog.Logger, stdout io.Writer) error {
	if f.Since < 0 {
		return usagef("reprocess -since: want a positive duration, such as 720h")
	}
	if f.Event != "" && !eventName(f.Event) {
		return usagef("reprocess -event: want an event name (X-GitHub-Event), such as pull_request")
	}
	store, err := openExisting(ctx, cfg.Database)
	if err != nil {
		return err
	}
	defer store.Close()
	if err := store.Current(ctx); err != nil {
		return err
	}
	o := ReprocessOptions{Filter: RawFilter{Event: f.Event}, DryRun: f.DryRun, Pause: 10 * time.Millisecond}
	if f.Since > 0 {
		o.Filter.Since = time.Now().Add(-f.Since)
	}
	if terminal(stdout) {
		last := time.Time{}
		o.Progress = func(s ReprocessSummary) {
			if time.Since(last) < 200*time.Millisecond {
				return
			}
			last = time.Now()
			elapsed := time.Since(s.Started)
			rate := float64(s.Seen) / elapsed.Seconds()
			left := "-"
			if rate > 0 && s.Total > s.Seen {
				left = (time.Duration(float64(s.Total-s.Seen)/rate) * time.Second).Round(time.Second).String()
			}
			fmt.Fprintf(stdout, "\r%d of %d rows, %.0f rows/s, %s left\033[K", s.Seen, s.Total, rate, left)
		}
	}
	sum, err := Reprocess(ctx, store, cfg.GitHub.BotAppID, o, log)
	if terminal(stdout) {
		fmt.Fprint(stdout, "\r\033[K")
	}
	printReprocessed(stdout, sum, f.DryRun)
	if err != nil {
		return fmt.Errorf("reprocess stopped after %d of %d rows (a run again starts over, and changes nothing twice): %w", sum.Seen, sum.Total, err)
	}
	return nil
}

// printReprocessed prints a run's summary.
func printReprocessed(w io.Writer, s ReprocessSummary, dryRun bool) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "raw rows read\t%d of %d\n", s.Seen, s.Total)
	if dryRun {
		fmt.Fprintf(tw, "would change typed rows\t%d (dry run: each batch rolled back, nothing written)\n", s.Written)
	} else {
		fmt.Fprintf(tw, "changed typed rows\t%d\n", s.Written)
	}
	fmt.Fprintf(tw, "unchanged\t%d (the tables hold what they make, or a newer object)\n", s.Unchanged)
	for _, reason := range slices.Sorted(maps.Keys(s.Skipped)) {
		fmt.Fprintf(tw, "skipped\t%d: %s\n", s.Skipped[reason], reason)
	}
	tw.Flush()
	fmt.Fprintf(w, "in %s\n", time.Since(s.Started).Round(time.Millisecond))
}
