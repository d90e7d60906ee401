package main

import (
	"context"
	"log/slog"
	"maps"
	"slices"

	"go.uber.org/zap/zapcore"
)

// slogCore is a zap core that hands its entries to a slog.Logger: the log
// of a library that logs through zap (certmagic) in the daemon's own, at
// info and above.
type slogCore struct {
	log    *slog.Logger
	fields []zapcore.Field
}

func (c slogCore) Enabled(l zapcore.Level) bool { return l >= zapcore.InfoLevel }

func (c slogCore) With(fields []zapcore.Field) zapcore.Core {
	return slogCore{log: c.log, fields: append(slices.Clip(c.fields), fields...)}
}

func (c slogCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

func (c slogCore) Write(e zapcore.Entry, fields []zapcore.Field) error {
	enc := zapcore.NewMapObjectEncoder()
	for _, f := range append(slices.Clip(c.fields), fields...) {
		f.AddTo(enc)
	}
	args := make([]any, 0, 2*len(enc.Fields))
	for _, k := range slices.Sorted(maps.Keys(enc.Fields)) {
		args = append(args, k, enc.Fields[k])
	}
	level := slog.LevelInfo
	switch {
	case e.Level >= zapcore.ErrorLevel:
		level = slog.LevelError
	case e.Level == zapcore.WarnLevel:
		level = slog.LevelWarn
	}
	c.log.Log(context.Background(), level, e.Message, args...)
	return nil
}

func (c slogCore) Sync() error { return nil }
