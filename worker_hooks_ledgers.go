package main

import (
	"context"
	"strings"
	"time"
)

// LedgerView is one hook's ledger as the status shows it: which hook,
// where its next poll begins, its open gaps, and, while GitHub refuses
// it, since when and why.
type LedgerView struct {
	Hook         int64      `json:"hook"` // 0: the App's own hook
	Name         string     `json:"name"`
	Checkpoint   *time.Time `json:"checkpoint,omitempty"`
	OpenGaps     int        `json:"open_gaps"`
	Refused      string     `json:"refused,omitempty"`
	RefusedSince *time.Time `json:"refused_since,omitempty"`
}

// Views are the ledgers as the status shows them.
func (h *Hooks) Views(ctx context.Context) ([]LedgerView, error) {
	open, err := h.store.OpenGapsByHook(ctx)
	if err != nil {
		return nil, err
	}
	views := make([]LedgerView, 0, len(h.ledgers))
	for _, l := range h.ledgers {
		v := LedgerView{Hook: l.Hook(), Name: l.String(), OpenGaps: open[l.Hook()]}
		cp, err := h.store.Setting(ctx, checkpointKey(l.Hook()))
		if err != nil {
			return nil, err
		}
		if t, err := time.Parse(time.RFC3339Nano, cp); err == nil {
			v.Checkpoint = &t
		}
		refused, err := h.store.Setting(ctx, refusedKey(l.Hook()))
		if err != nil {
			return nil, err
		}
		if at, why, ok := strings.Cut(refused, " "); ok {
			v.Refused = why
			if t, err := time.Parse(time.RFC3339Nano, at); err == nil {
				v.RefusedSince = &t
			}
		}
		views = append(views, v)
	}
	return views, nil
}

// RegisterMetrics registers each ledger's gauges, labelled by hook ("app"
// for the App's own): its open gaps, and whether GitHub refuses it, read
// from the database at each scrape.
func (h *Hooks) RegisterMetrics(m *Metrics) {
	if m == nil {
		return
	}
	read := func(value func(LedgerView) float64) func() map[string]float64 {
		return func() map[string]float64 {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			views, err := h.Views(ctx)
			if err != nil {
				return nil
			}
			out := make(map[string]float64, len(views))
			for _, v := range views {
				out[hookName(v.Hook)] = value(v)
			}
			return out
		}
	}
	m.GaugesFunc("switchyard_ledger_open_gaps", "Open delivery gaps of each hook's ledger (hook: its ID, app for the App's own).", "hook",
		read(func(v LedgerView) float64 { return float64(v.OpenGaps) }))
	m.GaugesFunc("switchyard_ledger_refused", "1 while GitHub refuses a hook's ledger (its token, installation or ID: 401, 403, 404), else 0.", "hook",
		read(func(v LedgerView) float64 {
			if v.Refused != "" {
				return 1
			}
			return 0
		}))
}
