// Command switchyard takes GitHub webhooks through RabbitMQ into SQLite, and
// follows its producer from broker to broker without losing or reordering an
// Event. See README.md.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"reflect"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	amqp "github.com/rabbitmq/amqp091-go"
	"golang.org/x/sync/errgroup"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(exitCode(err, os.Stderr))
}

// exitError is a failure with an exit status of its own: `status` exits 1
// when something needs the operator and 3 when it cannot read the daemon's
// answer, so that a script can tell the two apart.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// Exit statuses of `switchyard status` beyond 0, 1 and 2.
const exitUnreachable = 3

// usageError is bad usage: exit status 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{fmt.Sprintf(format, args...)} }

func exitCode(err error, stderr io.Writer) int {
	if err == nil {
		return 0
	}
	fmt.Fprintln(stderr, "switchyard:", err)
	var ue *usageError
	if errors.As(err, &ue) {
		fmt.Fprintln(stderr, "Run 'switchyard help' for usage.")
		return 2
	}
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	return 1
}

// command is one subcommand: its arguments, what it does, and its flags
// beyond -config.
type command struct {
	name, args, summary string
	nargs               int  // positional arguments it takes
	noConfig            bool // takes no -config
	flags               func(fs *flag.FlagSet, o *options)
}

// options are the flags of every command, filled by parsing.
type options struct {
	config     string
	replay     ReplayOptions
	deliveries DeliveriesOptions
	json       bool // queues, status
}

var commands = []command{
	{name: "serve", summary: "run the daemon until SIGTERM or SIGINT; SIGHUP reloads the config"},
	{name: "migrate", summary: "create or upgrade the database, then exit"},
	{name: "check-config", summary: "validate the config; print it with secrets masked, and any warnings"},
	{name: "backup", args: "DEST", nargs: 1, summary: "write a consistent snapshot of the database to DEST (mode 0600) while serve runs"},
	{name: "queues", summary: "all 12 queues on every broker: ready messages and consumers, the active broker and the pending target marked",
		flags: func(fs *flag.FlagSet, o *options) { fs.BoolVar(&o.json, "json", false, "print JSON") }},
	{name: "status", summary: "the running daemon's status: brokers, pending switch and what holds it, -error queues, workers, gaps",
		flags: func(fs *flag.FlagSet, o *options) {
			fs.BoolVar(&o.json, "json", false, "print GET /api/v1/status as it is")
		}},
	{name: "replay", args: "QUEUE", nargs: 1,
		summary: "move the messages QUEUE-error holds now back to QUEUE on the active broker",
		flags: func(fs *flag.FlagSet, o *options) {
			fs.IntVar(&o.replay.Limit, "limit", 0, "move at most this many messages (0: all that QUEUE-error holds now)")
			fs.IntVar(&o.replay.From, "broker", -1, "take them from this broker's QUEUE-error (index; default: the active broker)")
			fs.BoolVar(&o.replay.DryRun, "dry-run", false, "list delivery ID, event, x-error-reason and x-attempts; move nothing")
		}},
	{name: "deliveries", summary: "GitHub's deliveries by what became of them (stored, in flight, redelivered, gap), then the open gaps",
		flags: func(fs *flag.FlagSet, o *options) {
			fs.DurationVar(&o.deliveries.Since, "since", githubRedeliveryWindow, "look this far back (GitHub keeps 72h)")
			fs.BoolVar(&o.deliveries.Gaps, "gaps", false, "list only the open gaps the hooks worker recorded, without asking GitHub")
		}},
	{name: "version", noConfig: true, summary: "print the version and the Go version"},
	{name: "help", args: "[COMMAND]", noConfig: true, summary: "print this, or a command's usage and flags"},
}

func findCommand(name string) *command {
	for i := range commands {
		if commands[i].name == name {
			return &commands[i]
		}
	}
	return nil
}

// flagSet is the command's flags, parsed into o.
func (c *command) flagSet(o *options) *flag.FlagSet {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	if !c.noConfig {
		fs.StringVar(&o.config, "config", defaultConfigPath(), "config file ($SWITCHYARD_CONFIG, else ./switchyard.toml)")
	}
	if c.flags != nil {
		c.flags(fs, o)
	}
	return fs
}

// usage writes the command's usage line, what it does and its flags.
func (c *command) usage(w io.Writer) {
	line := "switchyard " + c.name
	if !c.noConfig {
		line += " [-config PATH]"
	}
	if c.args != "" {
		line += " " + c.args
	}
	if c.flags != nil {
		line += " [flags]"
	}
	fmt.Fprintf(w, "usage: %s\n\n%s.\n", line, strings.ToUpper(c.summary[:1])+c.summary[1:])
	fs := c.flagSet(&options{})
	if !c.noConfig {
		fmt.Fprintln(w, "\nflags:")
		fs.SetOutput(w)
		fs.PrintDefaults()
	}
}

// usageText writes the overview of `switchyard help`.
func usageText(w io.Writer) {
	fmt.Fprintln(w, "usage: switchyard COMMAND [flags] [arguments]")
	fmt.Fprintln(w, "\ncommands:")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, c := range commands {
		fmt.Fprintf(tw, "  %s %s\t%s\n", c.name, c.args, c.summary)
	}
	tw.Flush()
	fmt.Fprintln(w, "\nRun 'switchyard help COMMAND' or 'switchyard COMMAND -h' for a command's flags.")
}

// run is the whole program; the end-to-end tests call it.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return usagef("no command")
	}
	name, args := args[0], args[1:]
	switch name {
	case "-h", "-help", "--help":
		name = "help"
	case "-version", "--version":
		name = "version"
	}
	cmd := findCommand(name)
	if cmd == nil {
		return usagef("unknown command %q", name)
	}
	var o options
	pos, err := parseInterleaved(cmd.flagSet(&o), args)
	if errors.Is(err, flag.ErrHelp) {
		cmd.usage(stdout)
		return nil
	}
	if err != nil {
		return usagef("%s: %v", cmd.name, err)
	}
	if cmd.name == "help" && len(pos) <= 1 {
		if len(pos) == 0 {
			usageText(stdout)
			return nil
		}
		c := findCommand(pos[0])
		if c == nil {
			return usagef("help: unknown command %q", pos[0])
		}
		c.usage(stdout)
		return nil
	}
	if len(pos) != cmd.nargs {
		return usagef("%s takes %d argument(s), got %d", cmd.name, cmd.nargs, len(pos))
	}

	switch cmd.name {
	case "version":
		fmt.Fprintf(stdout, "switchyard %s (%s)\n", version, runtime.Version())
		return nil
	case "check-config":
		return checkConfig(o.config, stdout)
	}

	cfg, err := LoadConfig(o.config)
	if err != nil {
		return err
	}
	level := new(slog.LevelVar)
	log := newLogger(cfg.Log, level, stderr)
	switch cmd.name {
	case "serve":
		for _, w := range cfg.Warnings(o.config) {
			log.Warn("config: " + w)
		}
		return serve(ctx, cfg, o.config, level, log, func() { sdNotify(log, daemon.SdNotifyReady) })
	case "migrate":
		return migrate(ctx, cfg, stdout)
	case "backup":
		return backup(ctx, cfg, pos[0], stdout)
	case "queues":
		return listQueues(ctx, cfg, log, o.json, stdout)
	case "status":
		return printStatus(ctx, cfg, o.json, stdout)
	case "replay":
		return replay(ctx, cfg, log, pos[0], o.replay, stdout)
	case "deliveries":
		return listDeliveries(ctx, cfg, log, o.deliveries, stdout)
	}
	return nil
}

// parseInterleaved parses flags that may stand before or after the positional
// arguments ("replay QUEUE -limit 5").
func parseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

func defaultConfigPath() string {
	if p := os.Getenv("SWITCHYARD_CONFIG"); p != "" {
		return p
	}
	return "switchyard.toml"
}

// newLogger sets up log/slog once, at level (which a reload may change).
// Under systemd (JOURNAL_STREAM set) the time is left to journald, which
// stamps every line, and each line starts with its syslog priority, so that
// `journalctl -p warning` finds the warnings.
func newLogger(cfg LogConfig, level *slog.LevelVar, w io.Writer) *slog.Logger {
	level.Set(parseLevel(cfg.Level))
	opts := &slog.HandlerOptions{Level: level}
	newHandler := func(w io.Writer) slog.Handler {
		if cfg.Format == "json" {
			return slog.NewJSONHandler(w, opts)
		}
		return slog.NewTextHandler(w, opts)
	}
	if os.Getenv("JOURNAL_STREAM") == "" {
		return slog.New(newHandler(w))
	}
	opts.ReplaceAttr = func(groups []string, a slog.Attr) slog.Attr {
		if len(groups) == 0 && a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}
	lw := &lockedWriter{w: w}
	var h journalHandler
	for i, prio := range journalPriorities {
		h.levels[i] = newHandler(&prefixWriter{w: lw, prefix: prio})
	}
	return slog.New(h)
}

func parseLevel(s string) slog.Level {
	return map[string]slog.Level{"debug": slog.LevelDebug, "info": slog.LevelInfo, "warn": slog.LevelWarn, "error": slog.LevelError}[s]
}

// journalPriorities are the sd-daemon prefixes of debug, info, warn, error.
var journalPriorities = [4]string{"<7>", "<6>", "<4>", "<3>"}

// journalHandler writes each record through the handler of its level, whose
// lines carry that level's priority prefix.
type journalHandler struct{ levels [4]slog.Handler }

func (h journalHandler) index(l slog.Level) int {
	switch {
	case l >= slog.LevelError:
		return 3
	case l >= slog.LevelWarn:
		return 2
	case l >= slog.LevelInfo:
		return 1
	}
	return 0
}

func (h journalHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.levels[h.index(l)].Enabled(ctx, l)
}

func (h journalHandler) Handle(ctx context.Context, r slog.Record) error {
	return h.levels[h.index(r.Level)].Handle(ctx, r)
}

func (h journalHandler) WithAttrs(as []slog.Attr) slog.Handler {
	for i := range h.levels {
		h.levels[i] = h.levels[i].WithAttrs(as)
	}
	return h
}

func (h journalHandler) WithGroup(name string) slog.Handler {
	for i := range h.levels {
		h.levels[i] = h.levels[i].WithGroup(name)
	}
	return h
}

// lockedWriter serializes the writes of the four level handlers.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

// prefixWriter writes each line (slog writes one per call) behind prefix.
type prefixWriter struct {
	w      *lockedWriter
	prefix string
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	p.w.mu.Lock()
	defer p.w.mu.Unlock()
	if _, err := p.w.w.Write(append([]byte(p.prefix), b...)); err != nil {
		return 0, err
	}
	return len(b), nil
}

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
	fmt.Fprintf(stdout, "database %s: schema version %d -> %d\n", cfg.Database.Path, from, to)
	return nil
}

// openExisting opens the database for a command that must not create one:
// run from another directory, a relative database.path would otherwise be a
// new, empty database, backed up or read as if it were the real one.
func openExisting(ctx context.Context, cfg DatabaseConfig) (*Store, error) {
	if _, err := os.Stat(cfg.Path); errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("database %s does not exist (only serve and migrate create one; a relative database.path is read from the current directory)", cfg.Path)
	}
	return OpenStore(ctx, cfg, nil)
}

func backup(ctx context.Context, cfg *Config, dest string, stdout io.Writer) error {
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
		b, err := ParseBroker(i, bc.URL)
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

// printStatus asks the running daemon for its status (GET /api/v1/status on
// server.listen, with the operator token) and prints it. It returns nil when
// all is well, an error naming each problem when something needs the
// operator (exit 1), and an exitError of exitUnreachable when it cannot read
// the daemon's whole answer (exit 3).
func printStatus(ctx context.Context, cfg *Config, asJSON bool, stdout io.Writer) error {
	host, port, err := net.SplitHostPort(cfg.Server.Listen)
	if err != nil {
		return fmt.Errorf("server.listen: %w", err)
	}
	if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	url := "http://" + net.JoinHostPort(host, port) + "/api/v1/status"
	unreachable := func(format string, args ...any) error {
		return &exitError{code: exitUnreachable, err: fmt.Errorf(format, args...)}
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+cfg.API.OperatorToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return unreachable("is switchyard serving on %s? %w", cfg.Server.Listen, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxStatusBytes+1))
	if err != nil {
		return unreachable("GET %s: %w", url, err)
	}
	if len(body) > maxStatusBytes {
		return unreachable("GET %s: the answer is over %d bytes", url, maxStatusBytes)
	}
	if resp.StatusCode != http.StatusOK {
		return unreachable("GET %s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	var st Status
	if err := json.Unmarshal(body, &st); err != nil {
		return unreachable("GET %s: %w", url, err)
	}
	if asJSON {
		if _, err := stdout.Write(body); err != nil {
			return err
		}
	} else {
		writeStatus(stdout, st)
	}
	if len(st.Problems) > 0 {
		return fmt.Errorf("needs the operator: %s", strings.Join(st.Problems, "; "))
	}
	return nil
}

// maxStatusBytes bounds the daemon's answer that `status` reads.
const maxStatusBytes = 16 << 20

// writeStatus prints a Status for a terminal.
func writeStatus(w io.Writer, st Status) {
	fmt.Fprintf(w, "switchyard %s (%s), up %s\n", st.Version, st.GoVersion, st.Now.Sub(st.StartedAt).Round(time.Second))
	for _, b := range st.Brokers {
		if b.Active {
			fmt.Fprintf(w, "active broker: #%d %s vhost %s\n", b.Index, b.Host, b.Vhost)
		}
	}
	if p := st.Pending; p != nil {
		fmt.Fprintf(w, "pending switch: to #%d (%s vhost %s), switched at %s\n", p.Index, p.Host, p.Vhost, p.SwitchedAt.Format(time.RFC3339))
		for _, h := range p.HeldBy {
			fmt.Fprintf(w, "  waits for %s on #%d: %s\n", h.Queue, h.Broker, plural(h.Messages, "message"))
		}
	} else {
		fmt.Fprintln(w, "pending switch: none")
	}
	fmt.Fprintf(w, "messages in -error queues: %d\n", st.ErrorMessages)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "\nBROKER\tUP\tROLE\tNON-EMPTY QUEUES")
	for _, b := range st.Brokers {
		var held []string
		for _, q := range allQueues() {
			if n := b.Queues[q].Ready; n > 0 {
				held = append(held, fmt.Sprintf("%s=%d", q, n))
			}
		}
		up := "up"
		if !b.Up {
			up, held = "down", []string{b.Error}
		}
		fmt.Fprintf(tw, "#%d %s vhost %s\t%s\t%s\t%s\n", b.Index, b.Host, b.Vhost, up, b.Role(), strings.Join(held, " "))
	}
	fmt.Fprintln(tw, "\nWORKER\tLAST CYCLE\tLAST STORED\tFAILURES")
	for _, wk := range st.Workers {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d %s\n", wk.Name, lastCycle(st.Now, wk), ago(st.Now, wk.LastStored), wk.Failures, wk.LastError)
	}
	tw.Flush()
	if f := forbiddenRead(st.Now, st.Workers); f != "" {
		fmt.Fprintf(w, "github-forbidden: %s\n", f)
	}
	total := 0
	for _, b := range st.Statistics {
		total += b.Count
	}
	fmt.Fprintf(w, "\nevents in the last 7 days: %d\ndatabase: %s, %d bytes, %d raw rows\nopen delivery gaps: %d (%d unrecoverable)\n",
		total, st.Database.Path, st.Database.SizeBytes, st.Database.Rows["github"], st.GapsTotal, st.Unrecoverable)
	for _, g := range st.Gaps {
		state := ""
		if g.UnrecoverableAt != nil {
			state = " (unrecoverable)"
		}
		fmt.Fprintf(w, "  %s %s delivered %s%s\n", g.GUID, g.Event, g.DeliveredAt.Format(time.RFC3339), state)
	}
	if st.GapsTotal > len(st.Gaps) {
		fmt.Fprintf(w, "  ... the newest %d of %d listed; switchyard deliveries -gaps for more\n", len(st.Gaps), st.GapsTotal)
	}
	if len(st.Problems) == 0 {
		fmt.Fprintln(w, "\nall is well")
		return
	}
	fmt.Fprintln(w, "\nneeds the operator:")
	for _, p := range st.Problems {
		fmt.Fprintf(w, "  %s\n", p)
	}
}

// listedGaps is the most open gaps `deliveries` lists.
const listedGaps = 1000

// DeliveriesOptions are the deliveries command's flags.
type DeliveriesOptions struct {
	Since time.Duration // how far back to ask GitHub
	Gaps  bool          // only the open gaps, from the database
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
		if cfg.GitHub.AppID == 0 {
			return errors.New("github.app_id is 0: asking GitHub for its deliveries needs the App (-gaps lists the recorded gaps)")
		}
		app, err := NewGitHubApp(cfg.GitHub, log)
		if err != nil {
			return err
		}
		now := time.Now().UTC()
		since := now.Add(-min(max(o.Since, 0), githubRedeliveryWindow))
		ctx, cancel := context.WithTimeout(ctx, ledgerTimeout)
		defer cancel()
		entries, _, complete, err := ledger(ctx, app, store, since, now, cfg.GitHub.ReconcileGrace, cfg.GitHub.MaxPagesPerPoll)
		if err != nil {
			return err
		}
		counts := map[string]int{}
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
	}
	gaps, total, err := store.OpenGaps(ctx, listedGaps)
	if err != nil {
		return err
	}
	if total == 0 {
		fmt.Fprintln(tw, "no open gaps")
		return tw.Flush()
	}
	fmt.Fprintln(tw, "OPEN GAP\tEVENT\tDELIVERED\tFOUND\tREDELIVERED\tSTATE")
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
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", g.GUID, g.Event, g.DeliveredAt.UTC().Format(time.RFC3339),
			g.FoundAt.UTC().Format(time.RFC3339), redelivered, state)
	}
	if total > len(gaps) {
		fmt.Fprintf(tw, "\n%d open gaps in all; the newest %d listed\n", total, len(gaps))
	}
	return tw.Flush()
}

// operatorQueues is the AMQP side for the queues and replay commands. They
// work on the queues as they are, so they never declare (and never fail on a
// declare that the running daemon's retry_ttl would contradict).
func operatorQueues(cfg *Config, brokers []*Broker, log *slog.Logger) *Queues {
	qcfg := cfg.Queue
	qcfg.DeclareTopology = false
	return NewQueues(qcfg, brokers, nil, log)
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

// Daemon is `switchyard serve`: the store, the brokers, the HTTP server and
// the workers, with one lifetime.
type Daemon struct {
	cfg     *Config
	log     *slog.Logger
	store   *Store
	brokers *Brokers
	queues  *Queues
	metrics *Metrics
	api     *API
	alerter *Alerter
	alerts  *AlertSender
	fleet   *Fleet
	workers []*Worker
}

// NewDaemon opens and migrates the database and wires everything; nothing runs
// until Run.
func NewDaemon(ctx context.Context, cfg *Config, log *slog.Logger) (*Daemon, error) {
	metrics := NewMetrics(MetricLabels{Version: version, Queues: logicalQueues, Tables: orderSafeTables,
		Outcomes: outcomes})
	store, err := OpenStore(ctx, cfg.Database, metrics)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*Daemon, error) {
		store.Close()
		return nil, err
	}
	from, to, err := store.Migrate(ctx)
	if err != nil {
		return fail(err)
	}
	if from != to {
		log.Info("database migrated", "path", cfg.Database.Path, "from", from, "to", to)
	}
	brokers, err := NewBrokers(ctx, cfg.Brokers, store, metrics, log)
	if err != nil {
		return fail(err)
	}
	queues := NewQueues(cfg.Queue, brokers.List(), metrics, log)
	for _, b := range brokers.List() {
		metrics.broker(b.Index, b.Host, b.Vhost)
	}
	webhook, err := NewWebhook(cfg, brokers, queues, metrics, log)
	if err != nil {
		return fail(err)
	}
	d := &Daemon{cfg: cfg, log: log, store: store, brokers: brokers, queues: queues, metrics: metrics}
	w := cfg.Workers
	alerter := NewAlerter(cfg.Alerts, log.With("component", "alerts"))
	d.alerter, d.alerts = alerter, NewAlertSender(store, alerter, log)
	d.fleet = NewFleet(cfg.Queue, brokers.List(), queues, metrics, log)
	store.RegisterMetrics(metrics)
	hc := func(url, name string) *HealthCheck { return NewHealthCheck(url, name, d.metrics, log) }
	consumed := consumedQueues(cfg)
	worker := func(o WorkerOptions) *Worker {
		o.Consumed = consumed
		return NewWorker(o, w, brokers, queues, log)
	}
	retention := NewRetention(store, cfg.Database, log.With("worker", "cleanup"))
	d.workers = []*Worker{
		worker(WorkerOptions{Name: "service", Queue: queueGitHub, Handle: serviceHandler(store, alerter, false),
			Batch: store, Window: w.Window, Health: hc(cfg.HealthChecks.Service, "service")}),
		worker(WorkerOptions{Name: "database-service", Queue: queueDatabase,
			Handle:  databaseHandler(store, cfg.GitHub.BotAppID, metrics, log.With("worker", "database-service")),
			Prepare: databasePrepare(cfg.GitHub.BotAppID),
			Batch:   store, Window: w.Window, Health: hc(cfg.HealthChecks.DatabaseService, "database-service")}),
		worker(WorkerOptions{Name: "cleanup", Queue: queueForbidden, Handle: serviceHandler(store, alerter, true),
			Batch: store, Window: w.CleanupWindow, Every: w.CleanupEvery, Health: hc(cfg.HealthChecks.Cleanup, "cleanup"),
			Poll: func(ctx context.Context) error { _, _, err := retention.Prune(ctx); return err }, PollEvery: w.CleanupEvery}),
	}
	if cfg.GitHub.AppID > 0 {
		app, err := NewGitHubApp(cfg.GitHub, log.With("component", "github"))
		if err != nil {
			queues.Close()
			return fail(err)
		}
		hooks := &Hooks{app: app, store: store, brokers: brokers, queues: queues, alerter: alerter, timeout: cfg.Queue.PublishTimeout,
			grace: cfg.GitHub.ReconcileGrace, redeliver: cfg.GitHub.RedeliverGaps, maxPages: cfg.GitHub.MaxPagesPerPoll,
			log: log.With("worker", "hooks")}
		// The hooks worker talks to GitHub per message: it is not batched
		// (no network I/O inside a transaction). Its poll runs between
		// windows: a window longer than hooks_poll_every would stretch it.
		d.workers = append(d.workers, worker(WorkerOptions{Name: "hooks", Queue: queueHooks, HandleMessages: hooks.HandleMessages,
			Window: min(w.Window, w.HooksPollEvery), Health: hc(cfg.HealthChecks.Hooks, "hooks"), PollEvery: w.HooksPollEvery,
			Poll: func(ctx context.Context) error {
				n, err := hooks.Poll(ctx)
				if n > 0 {
					log.Info("hooks poll queued failed deliveries", "worker", "hooks", "queued", n)
				}
				return err
			}}))
	}
	d.api = NewAPI(cfg, store, brokers, queues, webhook, metrics, d.workers, log)
	return d, nil
}

// Close closes what NewDaemon opened: the broker connections, then the
// database. Call it once Run has returned.
func (d *Daemon) Close() error {
	return errors.Join(d.queues.Close(), d.store.Close())
}

// Run serves HTTP on ln and runs the workers until ctx ends (or a server or a
// worker fails), then shuts down in order, within shutdown_timeout: stop
// taking webhooks, then stop the workers, each of which finishes and acks the
// message in hand. ready, if set, is called once the listener accepts. The
// Daemon stays open: Close closes it.
func (d *Daemon) Run(ctx context.Context, ln net.Listener, ready func()) error {
	servers, listeners, err := d.httpServers(ln)
	if err != nil {
		return err
	}

	// The workers' context does not follow ctx: they stop only after the
	// HTTP servers have stopped taking webhooks.
	workCtx, stopWork := context.WithCancel(context.WithoutCancel(ctx))
	defer stopWork()
	work, wctx := errgroup.WithContext(workCtx)
	for _, w := range d.workers {
		work.Go(func() error { return w.Run(wctx) })
	}
	work.Go(func() error { return d.alerts.Run(wctx) })
	work.Go(func() error { return d.fleet.Run(wctx) })
	if interval, err := daemon.SdWatchdogEnabled(false); err == nil && interval > 0 {
		work.Go(func() error { d.watchdog(wctx, interval); return nil })
	}
	served := make(chan error, len(servers))
	for i, s := range servers {
		go func() { served <- s.Serve(listeners[i]) }()
	}
	d.log.Info("switchyard serving", "version", version, "listen", ln.Addr().String(),
		"database", d.cfg.Database.Path, "brokers", len(d.brokers.List()))
	if ready != nil {
		ready()
	}

	// Until a signal, or a server or a worker fails.
	var errs []error
	select {
	case <-ctx.Done():
	case err := <-served:
		errs = append(errs, fmt.Errorf("http: %w", err))
	case <-wctx.Done():
	}
	d.log.Info("shutting down")
	sdNotify(d.log, daemon.SdNotifyStopping)
	deadline := time.Now().Add(d.cfg.Server.ShutdownTimeout)

	// 1. Stop taking webhooks: every one answered 202 is on a broker.
	sctx, cancel := context.WithDeadline(context.Background(), deadline.Add(-d.cfg.Server.ShutdownTimeout/4))
	for _, s := range servers {
		if err := s.Shutdown(sctx); err != nil {
			errs = append(errs, fmt.Errorf("http shutdown: %w", err))
		}
	}
	cancel()

	// 2. Stop the workers; each finishes and acks the message in hand.
	stopWork()
	finished := make(chan error, 1)
	go func() { finished <- work.Wait() }()
	select {
	case err := <-finished:
		errs = append(errs, err)
	case <-time.After(time.Until(deadline)):
		errs = append(errs, fmt.Errorf("shutdown took longer than %s", d.cfg.Server.ShutdownTimeout))
	}
	return errors.Join(errs...)
}

// httpServers are the API server on ln and, with server.metrics_listen,
// the metrics server on its own listener.
func (d *Daemon) httpServers(ln net.Listener) ([]*http.Server, []net.Listener, error) {
	servers := []*http.Server{{
		Handler:           d.api.Handler(),
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       2 * time.Minute,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(d.log.Handler(), slog.LevelWarn),
	}}
	listeners := []net.Listener{ln}
	if addr := d.cfg.Server.MetricsListen; !d.cfg.Server.metricsOnAPI() {
		mln, err := net.Listen("tcp", addr)
		if err != nil {
			ln.Close()
			return nil, nil, fmt.Errorf("listen %s (server.metrics_listen): %w", addr, err)
		}
		servers = append(servers, &http.Server{Handler: d.metrics.Handler(), ReadHeaderTimeout: 10 * time.Second})
		listeners = append(listeners, mln)
	}
	return servers, listeners, nil
}

// watchdog proves to systemd (WatchdogSec) that the process is alive.
func (d *Daemon) watchdog(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval / 2)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			sdNotify(d.log, daemon.SdNotifyWatchdog)
		}
	}
}

// sdNotify tells systemd the daemon's state when NOTIFY_SOCKET is set
// (Type=notify); elsewhere it does nothing.
func sdNotify(log *slog.Logger, state string) {
	if _, err := daemon.SdNotify(false, state); err != nil {
		log.Warn("cannot notify systemd", "state", state, "error", err)
	}
}

// gcPercentUnderLimit is the collector's GOGC while a soft memory limit
// holds the heap: end to end over amqps the default 100 ran 440 collections
// in 30 s on a heap of ~20 MB, 5 to 10 % of the daemon's CPU per webhook
// (BENCHMARKS.md). 200 gave that back but let the heap grow to three times
// what is live: 6 MB more peak RSS end to end than 150. Since the payload
// is no longer copied on its way to SQLite (a sixth less garbage per
// webhook), 150 collects only a tenth more often than 200 did then.
const gcPercentUnderLimit = 150

// setGCLimits sets the Go runtime's soft memory limit (server.memory_limit;
// GOMEMLIMIT in the environment wins) and, under a limit, collects less
// often (gcPercentUnderLimit; GOGC in the environment wins). The limit makes
// the collector work harder as the heap nears it, so that garbage from large
// payloads does not double the footprint on a small VPS; below it, garbage
// from 25 KB webhooks may wait longer.
func setGCLimits(memoryLimit int64) {
	limited := os.Getenv("GOMEMLIMIT") != ""
	if !limited && memoryLimit > 0 {
		debug.SetMemoryLimit(memoryLimit)
		limited = true
	}
	if limited && os.Getenv("GOGC") == "" {
		debug.SetGCPercent(gcPercentUnderLimit)
	}
}

// serve is the serve command: listen, then run until SIGTERM or SIGINT.
// SIGHUP reloads the config file at path.
func serve(ctx context.Context, cfg *Config, path string, level *slog.LevelVar, log *slog.Logger, ready func()) error {
	setGCLimits(cfg.Server.MemoryLimit)
	d, err := NewDaemon(ctx, cfg, log)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.Server.Listen)
	if err != nil {
		return errors.Join(fmt.Errorf("listen %s: %w", cfg.Server.Listen, err), d.Close())
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	reloads := make(chan struct{})
	reloaded := make(chan struct{})
	go func() {
		defer close(reloaded)
		for {
			select {
			case <-reloads:
				return
			case <-hup:
				d.ReloadFile(path, level)
			}
		}
	}()
	err = d.Run(ctx, ln, ready)
	close(reloads)
	<-reloaded
	err = errors.Join(err, d.Close())
	log.Info("stopped", "error", err)
	return err
}

// reloadable are the config keys a SIGHUP applies at once;
// a key ending in "." stands for its whole section.
var reloadable = []string{"log.level", "github.webhook_secret", "github.previous_webhook_secrets",
	"github.allowed_cidrs", "github.meta_file", "server.trusted_proxies", "api.operator_token",
	"api.producer_token", "alerts.", "healthchecks."}

// ReloadFile reads the config file again and applies what may change while
// running: log level, webhook secrets, allow list and meta file, trusted
// proxies, API tokens, alerts and HealthChecks. Any other changed key is
// logged as needing a restart. A file that does not validate changes
// nothing, and every bad field is logged.
func (d *Daemon) ReloadFile(path string, level *slog.LevelVar) {
	cfg, err := LoadConfig(path)
	if err != nil {
		for _, line := range strings.Split(err.Error(), "\n") {
			d.log.Error("config reload refused, the running config stays", "problem", line)
		}
		return
	}
	if err := d.webhook().Reload(cfg); err != nil {
		d.log.Error("config reload refused, the running config stays", "problem", err)
		return
	}
	level.Set(parseLevel(cfg.Log.Level))
	tokens := cfg.API
	d.api.tokens.Store(&tokens)
	d.alerter.Reload(cfg.Alerts)
	urls := map[string]string{"service": cfg.HealthChecks.Service, "database-service": cfg.HealthChecks.DatabaseService,
		"hooks": cfg.HealthChecks.Hooks, "cleanup": cfg.HealthChecks.Cleanup}
	for _, w := range d.workers {
		w.Health.SetURL(urls[w.Name])
	}
	var restart []string
	for _, key := range changedKeys(d.cfg, cfg) {
		if !slices.ContainsFunc(reloadable, func(r string) bool { return key == r || strings.HasSuffix(r, ".") && strings.HasPrefix(key, r) }) {
			restart = append(restart, key)
		}
	}
	for _, w := range cfg.Warnings(path) {
		d.log.Warn("config: " + w)
	}
	d.log.Info("config reloaded", "path", path)
	for _, key := range restart {
		d.log.Warn("config key changed; it takes effect after a restart", "key", key)
	}
}

func (d *Daemon) webhook() *Webhook { return d.api.webhook }

// changedKeys names the config keys ("section.key", as in the file) whose
// values differ between a and b.
func changedKeys(a, b *Config) []string {
	var keys []string
	var walk func(prefix string, va, vb reflect.Value)
	walk = func(prefix string, va, vb reflect.Value) {
		if va.Kind() == reflect.Struct && va.Type() != reflect.TypeOf(time.Time{}) {
			for i := 0; i < va.NumField(); i++ {
				tag, _, _ := strings.Cut(va.Type().Field(i).Tag.Get("toml"), ",")
				if tag == "" || tag == "-" {
					continue
				}
				name := tag
				if prefix != "" {
					name = prefix + "." + tag
				}
				walk(name, va.Field(i), vb.Field(i))
			}
			return
		}
		if !reflect.DeepEqual(va.Interface(), vb.Interface()) {
			keys = append(keys, prefix)
		}
	}
	walk("", reflect.ValueOf(*a), reflect.ValueOf(*b))
	return keys
}
