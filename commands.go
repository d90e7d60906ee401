// The operator commands beside serve: check-config, migrate, backup,
// queues, deliveries, replay and outbox retry (status: commands_status.go).

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace/noop"
)

// usageError is bad usage: exit status 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{fmt.Sprintf(format, args...)} }

// exitError is a failure with an exit status of its own: `status` exits 1
// when something needs the operator and 3 when it cannot read the daemon's
// answer, so that a script can tell the two apart.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// Code is the exit status the failure asks for.
func (e *exitError) Code() int { return e.code }

// Exit statuses of `switchyard status` beyond 0, 1 and 2.
const exitUnreachable = 3

// checkConfig validates the file and prints a summary with secrets masked and
// any warnings, or every problem, one per line.
func checkConfig(path string, stdout io.Writer) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	cfg, err := ParseConfig(b)
	if err != nil {
		return fmt.Errorf("%s is not valid:\n  %s", path, strings.ReplaceAll(err.Error(), "\n", "\n  "))
	}
	fmt.Fprintf(stdout, "%s is valid\n", path)
	cfg.Summary(stdout)
	for _, w := range cfg.Warnings(path) {
		fmt.Fprintln(stdout, "warning:", w)
	}
	return nil
}

func migrate(ctx context.Context, cfg *Config, stdout io.Writer) error {
	store, err := OpenStore(ctx, cfg.Database, nil)
	if err != nil {
		return err
	}
	defer store.Close()
	from, to, err := store.Migrate(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "database %s: schema version %d -> %d\n", store.Name(), from, to)
	return nil
}

// openExisting opens the database for a command that must not create one:
// run from another directory, a relative database.path would otherwise be a
// new, empty database, backed up or read as if it were the real one.
func openExisting(ctx context.Context, cfg DatabaseConfig) (*Store, error) {
	if _, err := os.Stat(cfg.Path); cfg.Driver != "postgres" && errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("database %s does not exist (only serve and migrate create one; a relative database.path is read from the current directory)", cfg.Path)
	}
	return OpenStore(ctx, cfg, nil)
}

func backup(ctx context.Context, cfg *Config, dest string, stdout io.Writer) error {
	if cfg.Database.Driver == "postgres" {
		return fmt.Errorf("backup copies an SQLite file; database.driver is \"postgres\": use pg_dump, or the provider's backups " +
			"(switchyard copy-db -to FILE makes an SQLite copy too)")
	}
	store, err := openExisting(ctx, cfg.Database)
	if err != nil {
		return err
	}
	defer store.Close()
	start := time.Now()
	// Created empty first, so the copy is never readable by others, not even
	// while it is written; VACUUM INTO writes into an empty file.
	f, err := os.OpenFile(dest, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("backup: %s exists; refusing to overwrite it", dest)
	}
	if err != nil {
		return fmt.Errorf("backup: %w", err)
	}
	f.Close()
	if err := store.Backup(ctx, dest); err != nil {
		os.Remove(dest)
		return err
	}
	fi, err := os.Stat(dest)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "backup of %s written to %s: %d bytes in %s; integrity_check ok\n",
		cfg.Database.Path, dest, fi.Size(), time.Since(start).Round(time.Millisecond))
	return nil
}

// listQueues prints all 12 queues on every broker, with the active broker
// and the pending target as the database records them (when it can be read).
func listQueues(ctx context.Context, cfg *Config, log *slog.Logger, asJSON bool, stdout io.Writer) error {
	var brokers []*Broker
	for i, bc := range cfg.Brokers {
		b, err := NewBroker(i, bc)
		if err != nil {
			return err
		}
		brokers = append(brokers, b)
	}
	state := "the database cannot be read, so the active broker is not marked"
	active, pending := -1, -1
	if store, err := openExisting(ctx, cfg.Database); err == nil {
		if bs, err := NewBrokers(ctx, cfg.Brokers, store, nil, log); err == nil {
			st := bs.Cached()
			active, state = st.Active, ""
			if st.Pending != nil {
				pending = st.Pending.Index
			}
		}
		store.Close()
	}
	queues := operatorQueues(cfg, brokers, log)
	defer queues.Close()
	views := make([]BrokerView, len(brokers))
	var unreachable int
	for i, b := range brokers {
		v := BrokerView{Index: b.Index, Host: b.Host, Vhost: b.Vhost, Active: b.Index == active, Pending: b.Index == pending}
		qs, missing, err := queues.Inspect(ctx, b)
		if err != nil {
			unreachable++
			v.Error = err.Error()
		} else {
			v.Up, v.Queues, v.Missing = true, qs, missing
		}
		views[i] = v
	}
	if asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(views); err != nil {
			return err
		}
	} else {
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "BROKER\tROLE\tQUEUE\tREADY\tCONSUMERS")
		for i, v := range views {
			role := v.Role()
			if !v.Up {
				fmt.Fprintf(tw, "%s\t%s\t-\tunreachable: %s\t\n", brokers[i], role, v.Error)
				continue
			}
			for _, q := range allQueues() {
				if slices.Contains(v.Missing, q) {
					fmt.Fprintf(tw, "%s\t%s\t%s\tmissing\t\n", brokers[i], role, q)
					continue
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\n", brokers[i], role, q, v.Queues[q].Ready, v.Queues[q].Consumers)
			}
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		fmt.Fprintln(stdout, "(unacked counts are reported only by RabbitMQ's management API, which switchyard does not use)")
		if state != "" {
			fmt.Fprintln(stdout, "("+state+")")
		}
	}
	if unreachable == len(brokers) {
		return errors.New("no broker reachable")
	}
	return nil
}

// retryOutbox is `switchyard outbox retry`: the rows of the outbox the
// broker refused for good wait again, and the daemon that holds them
// forwards them (refused again while the broker's limit is as it was).
func retryOutbox(ctx context.Context, cfg *Config, stdout io.Writer) error {
	store, err := openExisting(ctx, cfg.Database)
	if err != nil {
		return err
	}
	defer store.Close()
	var n int64
	if err := store.WriteTx(ctx, func(tx *Tx) (err error) { n, err = tx.RetryRefused(ctx); return err }); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s the broker refused wait in the outbox again: the daemon forwards them\n", plural(int(n), "webhook"))
	return nil
}

// listedGaps is the most open gaps `deliveries` lists.
const listedGaps = 1000

// DeliveriesOptions are the deliveries command's flags.
type DeliveriesOptions struct {
	Since   time.Duration // how far back to ask GitHub
	Gaps    bool          // only the open gaps, from the database
	Payload bool          // show: the stored payload too
	Hook    int64         // only this hook's ledger (0: the App's); show: only this hook's copy; -1: every one
}

// listDeliveries prints GitHub's deliveries of the window with what became of
// each, a count per outcome, and the open gaps; with -gaps, the open gaps
// only.
func listDeliveries(ctx context.Context, cfg *Config, log *slog.Logger, o DeliveriesOptions, stdout io.Writer) error {
	store, err := openExisting(ctx, cfg.Database)
	if err != nil {
		return err
	}
	defer store.Close()
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	if !o.Gaps {
		ledgers, err := hookLedgers(cfg, log)
		if err != nil {
			return err
		}
		if o.Hook >= 0 {
			ledgers = slices.DeleteFunc(ledgers, func(l *HookLedger) bool { return l.Hook() != o.Hook })
		}
		if len(ledgers) == 0 {
			return fmt.Errorf("no hook's ledger to ask GitHub for%s: the App's needs github.app_id, a repository's or "+
				"organization's webhook its [[github.hooks]] entry with repository or organization (-gaps lists the recorded gaps)",
				map[bool]string{true: fmt.Sprintf(" (-hook %d)", o.Hook), false: ""}[o.Hook >= 0])
		}
		now := time.Now().UTC()
		since := now.Add(-min(max(o.Since, 0), cfg.GitHub.DeliveryWindow))
		for _, l := range ledgers {
			if err := printLedger(ctx, tw, l, store, since, now, cfg); err != nil {
				return err
			}
		}
	}
	gaps, total, err := store.OpenGaps(ctx, listedGaps)
	if err != nil {
		return err
	}
	if total == 0 {
		fmt.Fprintln(tw, "no open gaps")
		return tw.Flush()
	}
	fmt.Fprintln(tw, "OPEN GAP\tHOOK\tEVENT\tDELIVERED\tFOUND\tREDELIVERED\tSTATE")
	for _, g := range gaps {
		redelivered := "-"
		if g.RedeliveredAt != nil {
			redelivered = g.RedeliveredAt.UTC().Format(time.RFC3339)
		}
		state := "open"
		switch {
		case g.UnrecoverableAt != nil:
			state = "unrecoverable: " + g.LastError
		case g.Refusals > 0:
			state = fmt.Sprintf("open, %s: %s", plural(g.Refusals, "refusal"), g.LastError)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", g.GUID, hookName(g.Hook), g.Event, g.DeliveredAt.UTC().Format(time.RFC3339),
			g.FoundAt.UTC().Format(time.RFC3339), redelivered, state)
	}
	if total > len(gaps) {
		fmt.Fprintf(tw, "\n%d open gaps in all; the newest %d listed\n", total, len(gaps))
	}
	return tw.Flush()
}

// printLedger prints l's deliveries since since with what became of each,
// and a count per outcome.
func printLedger(ctx context.Context, tw io.Writer, l *HookLedger, store *Store, since, now time.Time, cfg *Config) error {
	ctx, cancel := context.WithTimeout(ctx, ledgerTimeout)
	defer cancel()
	entries, _, complete, err := ledger(ctx, l, store, since, now, cfg.GitHub.ReconcileGrace, cfg.GitHub.MaxPagesPerPoll)
	if err != nil {
		return fmt.Errorf("%s: %w", l, err)
	}
	counts := map[string]int{}
	fmt.Fprintf(tw, "%s\n", l)
	fmt.Fprintln(tw, "OUTCOME\tGUID\tEVENT\tLAST ATTEMPT\tSTATUS")
	for _, e := range entries {
		counts[e.Outcome]++
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\n", e.Outcome, e.GUID, e.Event, e.Latest.DeliveredAt.UTC().Format(time.RFC3339), e.Latest.StatusCode)
	}
	fmt.Fprintf(tw, "\n%d deliveries since %s: %d stored, %d in flight, %d redelivered, %d gap\n", len(entries),
		since.Format(time.RFC3339), counts[ledgerStored], counts[ledgerInFlight], counts[ledgerRedelivered], counts[ledgerGap])
	if !complete {
		fmt.Fprintf(tw, "(GitHub's list stopped after github.max_pages_per_poll = %d pages, or at a repeated cursor: older deliveries not shown)\n",
			cfg.GitHub.MaxPagesPerPoll)
	}
	fmt.Fprintln(tw)
	return nil
}

// operatorQueues is the AMQP side for the queues and replay commands. They
// work on the queues as they are, so they never declare (and never fail on a
// declare that the running daemon's retry_ttl would contradict).
func operatorQueues(cfg *Config, brokers []*Broker, log *slog.Logger) *Queues {
	qcfg := cfg.Queue
	qcfg.DeclareTopology = false
	return NewQueues(qcfg, brokers, nil, noop.NewTracerProvider(), log)
}

// ReplayOptions are the replay command's flags.
type ReplayOptions struct {
	Limit  int  // at most this many; 0: all that QUEUE-error held at the start
	From   int  // the broker whose QUEUE-error is read; -1: the active one
	DryRun bool // list, move nothing
}

// replay moves messages from QUEUE-error back to QUEUE on the active broker:
// each is published with a confirm before it is acked, so stopping half way
// loses nothing (at worst a message is in both, and the workers' duplicate
// check takes care of it). It moves at most what QUEUE-error held when it
// began: a message that fails again while it runs is left for the next run.
func replay(ctx context.Context, cfg *Config, log *slog.Logger, queue string, opts ReplayOptions, stdout io.Writer) error {
	queue = strings.TrimSuffix(queue, "-error")
	if !slices.Contains(logicalQueues, queue) {
		return usagef("replay: unknown queue %q (want one of %s)", queue, strings.Join(logicalQueues, ", "))
	}
	store, err := openExisting(ctx, cfg.Database)
	if err != nil {
		return err
	}
	defer store.Close()
	brokers, err := NewBrokers(ctx, cfg.Brokers, store, nil, log)
	if err != nil {
		return err
	}
	st, err := brokers.State(ctx)
	if err != nil {
		return err
	}
	to, err := brokers.Get(st.Active)
	if err != nil {
		return err
	}
	from := to
	if opts.From >= 0 {
		if from, err = brokers.Get(opts.From); err != nil {
			return usagef("replay -broker: %v", err)
		}
	}
	queues := operatorQueues(cfg, brokers.List(), log)
	defer queues.Close()
	// What the replay spends counts against the brokers' budgets too.
	defer func() {
		if err := WriteUsage(context.WithoutCancel(ctx), store, queues, time.Now()); err != nil {
			log.Warn("the messages this replay spent are not counted in broker_usage", "error", err)
		}
	}()

	if opts.DryRun {
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "DELIVERY\tEVENT\tATTEMPTS\tREASON")
		n, err := queues.PeekErrors(ctx, from, queue, opts.Limit, func(d *amqp.Delivery) {
			attempts := "-"
			if v, ok := d.Headers[hdrErrorAttempts]; ok {
				attempts = fmt.Sprint(v)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", d.MessageId, d.Type, attempts, tableString(d.Headers, hdrErrorReason))
		})
		tw.Flush()
		fmt.Fprintf(stdout, "dry run: %d message(s) in %s on %s; nothing moved\n", n, errorQueue(queue), from)
		return err
	}
	progress := func(done, total int) {
		fmt.Fprintf(stdout, "replayed %d of %d\n", done, total)
	}
	n, total, err := queues.Replay(ctx, from, to, queue, opts.Limit, progress)
	fmt.Fprintf(stdout, "replayed %d of %d message(s) from %s on %s to %s on %s\n", n, total, errorQueue(queue), from, queue, to)
	return err
}
