package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// Rotation is queue.rotate_on_budget: when the broker switchyard publishes
// to has spent queue.rotate_at of its monthly_messages, or has blocked or
// refused publishes for queue.blocked_rotate_after, it records a Pending
// Switch to the next broker, exactly as a producer's notification would.
// Usage runs Check with every broker's spending at each of its checks.
type Rotation struct {
	bs           *Brokers
	brokers      []*Broker
	rotateAt     float64
	blockedAfter time.Duration
	queues       *Queues
	store        *Store
	alerter      *Alerter
	log          *slog.Logger
}

// NewRotation is cfg's rotation, nil when queue.rotate_on_budget is off.
func NewRotation(cfg *Config, bs *Brokers, queues *Queues, store *Store, alerter *Alerter, log *slog.Logger) *Rotation {
	if !cfg.Queue.RotateOnBudget {
		return nil
	}
	return &Rotation{bs: bs, brokers: bs.List(), rotateAt: cfg.Queue.RotateAt, blockedAfter: cfg.Queue.BlockedRotateAfter,
		queues: queues, store: store, alerter: alerter, log: log.With("worker", "rotation")}
}

// spent reports whether the broker of v counts as out of budget: past
// rotate_at of its monthly_messages, or blocking (or refusing) publishes
// for blocked_rotate_after.
func (r *Rotation) spent(v BudgetView, now time.Time) bool {
	if v.Monthly > 0 && v.UsedRatio >= r.rotateAt {
		return true
	}
	blk, blocked := r.queues.Blocked(r.brokers[v.Broker])
	return blocked && now.Sub(blk.Since) >= r.blockedAfter
}

// Check records a Pending Switch, as a producer's notification would, from
// a spent publish target to the next broker in config order that is not
// spent and answers; the workers follow once the old broker is drained. A
// Pending Switch already waiting is left alone: the producer's word and
// the operator's hand win. With no broker left it stays, and alerts once a
// budget month.
func (r *Rotation) Check(ctx context.Context, h Holding, views []BudgetView, now time.Time) error {
	st := r.bs.Cached()
	if st.Pending != nil || !r.spent(views[st.Active], now) {
		return nil
	}
	from := r.brokers[st.Active]
	for i := 1; i < len(r.brokers); i++ {
		to := r.brokers[(st.Active+i)%len(r.brokers)]
		if r.spent(views[to.Index], now) || r.queues.Reachable(ctx, to) != nil {
			continue
		}
		if !h.Held() {
			return nil // another node's step now
		}
		result, _, err := r.bs.NotifyUnder(ctx, h.fence(), to.Host, to.Vhost, now)
		if errors.Is(err, ErrStale) {
			return nil // a switch of this moment or later was recorded meanwhile (a check beside this one)
		}
		if err != nil {
			return fmt.Errorf("record a pending switch from %s to %s: %w", from, to, err)
		}
		r.log.Warn("broker budget spent: publishing moves to the next broker; the workers follow once it is drained",
			"from", from.String(), "to", to.String(), "result", result)
		return nil
	}
	id := fmt.Sprintf("budget:every broker:%s:none", views[st.Active].MonthStart.Format("2006-01-02"))
	queued, err := queueOwnAlert(ctx, h, r.store, r.alerter, id, AlertIntent{Name: "budget", Action: "none"})
	if queued {
		r.log.Error("broker budget spent, and no broker is left under queue.rotate_at that answers: publishing stays", "broker", from.String())
	}
	return err
}
