// Command switchyard takes GitHub webhooks through RabbitMQ into SQLite, and
// follows its producer from broker to broker without losing or reordering an
// Event. See README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/coreos/go-systemd/v22/daemon"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(exitCode(err, os.Stderr))
}

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
		return ee.Code()
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
	config      string
	replay      ReplayOptions
	deliveries  DeliveriesOptions
	json        bool   // queues, status
	checkBroker int    // check-broker -broker
	copyTo      string // copy-db -to
	reprocess   ReprocessFlags
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
	{name: "deliveries", args: "[show GUID]", summary: "GitHub's deliveries by what became of them (stored, in flight, redelivered, gap), then the open gaps; show GUID: one delivery's whole story",
		flags: func(fs *flag.FlagSet, o *options) {
			fs.DurationVar(&o.deliveries.Since, "since", githubRedeliveryWindow, "look this far back (GitHub keeps 72h; at most github.delivery_window)")
			fs.BoolVar(&o.deliveries.Gaps, "gaps", false, "list only the open gaps the hooks worker recorded, without asking GitHub")
			fs.BoolVar(&o.deliveries.Payload, "payload", false, "show: print the stored payload too")
			fs.Int64Var(&o.deliveries.Hook, "hook", -1, "only this hook's ledger (its ID; 0: the App's); show: only the copy sent to this hook (X-GitHub-Hook-ID; 0: none recorded)")
			fs.BoolVar(&o.json, "json", false, "show: print the story as JSON")
		}},
	{name: "reprocess", summary: "derive the typed tables and release tracking again from the raw log's payloads, in received order, while serve runs; a second run changes nothing",
		flags: func(fs *flag.FlagSet, o *options) {
			fs.DurationVar(&o.reprocess.Since, "since", 0, "only the deliveries received this far back (default: the whole raw log)")
			fs.StringVar(&o.reprocess.Event, "event", "", "only this event (X-GitHub-Event), such as pull_request")
			fs.BoolVar(&o.reprocess.DryRun, "dry-run", false, "tell what it would change, each batch rolled back; write nothing")
		}},
	{name: "check-broker", summary: "check one configured broker for what switchyard relies on (confirms, returns, fanout, the retry cycle, a 20 MiB compressed message, the topology); exit 1 when it does not fit",
		flags: func(fs *flag.FlagSet, o *options) {
			fs.IntVar(&o.checkBroker, "broker", 0, "the broker to check (index)")
		}},
	{name: "copy-db", summary: "copy every table of the database into an empty one of the other kind (-to a postgres:// URL, or an SQLite file path), migrated to the same version, in one transaction",
		flags: func(fs *flag.FlagSet, o *options) {
			fs.StringVar(&o.copyTo, "to", "", "the target database: a postgres:// URL, or an SQLite file path")
		}},
	{name: "outbox", args: "retry", nargs: 1, summary: "retry: put the webhooks the broker refused for good (over its max_message_size) back in the outbox, once its limit is raised; the daemon forwards them"},
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
	if cmd.name == "deliveries" && len(pos) > 0 {
		if len(pos) != 2 || pos[0] != "show" {
			return usagef("deliveries takes no argument, or show GUID")
		}
		cfg, err := LoadConfig(o.config)
		if err != nil {
			return err
		}
		return showDelivery(ctx, cfg, pos[1], o.deliveries.Hook, o.deliveries.Payload, o.json, stdout)
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
	case "reprocess":
		return reprocess(ctx, cfg, o.reprocess, log, stdout)
	case "check-broker":
		return checkBroker(ctx, cfg, o.checkBroker, log, stdout)
	case "outbox":
		if pos[0] != "retry" {
			return usagef("outbox takes retry, got %q", pos[0])
		}
		return retryOutbox(ctx, cfg, stdout)
	case "copy-db":
		if o.copyTo == "" {
			return usagef("copy-db: -to TARGET is required (a postgres:// URL, or an SQLite file path)")
		}
		return copyDB(ctx, cfg, o.copyTo, stdout)
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
