// Logging: log/slog set up once, with journald priorities under systemd.

package main

import (
	"context"
	"io"
	"log/slog"
	"os"
	"sync"
)

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
