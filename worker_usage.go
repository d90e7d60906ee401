package main

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"time"
)

// budgetEvery is how often the counted messages are written to broker_usage
// and the budgets checked.
const budgetEvery = 10 * time.Second

// Usage keeps what each broker costs: the messages the queues counted
// (publishes, deliveries and basic.get-oks) go to broker_usage, so that they
// survive restarts, in the transactions the workers' batches commit and,
// for what is left (publishes while nothing is consumed), every
// budgetEvery and at shutdown. It sets the budget gauges, alerts once per
// broker and budget month when a broker passes queue.budget_warn_at of its
// monthly_messages and once when it passes all of it, and once per block
// of a broker; then it hands the brokers' spending to the Rotation, when
// there is one. It talks to no broker: an idle daemon spends nothing on it.
type Usage struct {
	bs      *Brokers
	brokers []*Broker
	cfgs    []BrokerConfig
	warnAt  float64
	queues  *Queues
	store   *Store
	alerter *Alerter
	metrics *Metrics
	log     *slog.Logger
	// then is run on every check with the brokers' spending, under the
	// budget lease's holding: the daemon's Rotation, with
	// queue.rotate_on_budget; nil for none.
	then func(ctx context.Context, h Holding, views []BudgetView, now time.Time) error
}

// NewUsage keeps the budgets of cfg's brokers: every node writes what it
// counted and sets its gauges (Run); the alerts and then are the budget
// lease's job (Budget).
func NewUsage(cfg *Config, bs *Brokers, queues *Queues, store *Store, alerter *Alerter, metrics *Metrics, log *slog.Logger,
	then func(ctx context.Context, h Holding, views []BudgetView, now time.Time) error) *Usage {
	return &Usage{bs: bs, brokers: bs.List(), cfgs: cfg.Brokers, warnAt: cfg.Queue.BudgetWarnAt, queues: queues, store: store,
		alerter: alerter, metrics: metrics, log: log.With("worker", "usage"), then: then}
}

// BudgetView is one broker's spending this budget month, for the status.
type BudgetView struct {
	Broker     int       `json:"broker"`
	Published  int64     `json:"published"`
	Delivered  int64     `json:"delivered"`
	Monthly    int64     `json:"monthly_messages,omitempty"` // 0: no quota
	UsedRatio  float64   `json:"used_ratio,omitempty"`
	MonthStart time.Time `json:"month_start"`
	MonthEnd   time.Time `json:"month_end"`
	// Projected is the month's end at the last 24 hours' rate, and RunsOut
	// the moment the quota would be spent at that rate, when before then;
	// both only once a whole day has been counted (ProjectedFrom), as a
	// rate of the last hours says nothing of a day's.
	Projected     *int64    `json:"projected"`
	ProjectedFrom time.Time `json:"projected_from,omitzero"`
	RunsOut       time.Time `json:"runs_out,omitzero"`
}

// ProjectionText is Projected for people: the number, or when there
// will be one.
func (v BudgetView) ProjectionText() string {
	if v.Projected != nil {
		return strconv.FormatInt(*v.Projected, 10)
	}
	return "too early (from " + v.ProjectedFrom.Format("2006-01-02 15:04") + ")"
}

// projectionNeeds is how long spending must have been counted before a
// month-end projection is made from its last 24 hours.
const projectionNeeds = 24 * time.Hour

// budgetMonth is the budget month that holds now, for a quota that starts
// anew on day (1-28) of each month, UTC.
func budgetMonth(now time.Time, day int) (start, end time.Time) {
	now = now.UTC()
	start = time.Date(now.Year(), now.Month(), day, 0, 0, 0, 0, time.UTC)
	if now.Before(start) {
		start = start.AddDate(0, -1, 0)
	}
	return start, start.AddDate(0, 1, 0)
}

// Run writes what the brokers cost and sets the gauges every budgetEvery
// until ctx ends (every node counts its own); the daemon writes what is
// left once the workers have stopped.
func (b *Usage) Run(ctx context.Context) error {
	t := time.NewTicker(budgetEvery)
	defer t.Stop()
	for {
		if err := b.Flush(ctx); err != nil && ctx.Err() == nil {
			b.log.Warn("broker usage not written, kept for the next try", "error", err)
		}
		select {
		case <-ctx.Done():
			return nil // the daemon writes the rest once the workers have stopped
		case <-t.C:
		}
	}
}

// Flush writes the messages counted since the last flush, then sets the
// gauges.
func (b *Usage) Flush(ctx context.Context) error {
	now := time.Now()
	if err := WriteUsage(ctx, b.store, b.queues, now); err != nil {
		return err
	}
	views, err := b.Views(ctx, now)
	if err != nil {
		return err
	}
	for _, v := range views {
		b.metrics.brokerMessages(v.Broker, v.Published, v.Delivered, v.UsedRatio)
	}
	return nil
}

// Budget is the budget lease's job: every budgetEvery until ctx ends, the
// alerts the blocks and the budgets call for and the rotation (Check),
// under h.
func (b *Usage) Budget(ctx context.Context, h Holding) error {
	t := time.NewTicker(budgetEvery)
	defer t.Stop()
	for {
		if err := b.Check(ctx, h); err != nil && ctx.Err() == nil {
			b.log.Warn("broker budgets not checked; trying again", "error", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Check queues the alerts the blocks and the budgets call for, and
// rotates when the budget says so, under h: a stale holding's change
// nothing.
func (b *Usage) Check(ctx context.Context, h Holding) error {
	now := time.Now()
	if err := b.alertBlocks(ctx, h); err != nil {
		return err
	}
	views, err := b.Views(ctx, now)
	if err != nil {
		return err
	}
	for _, v := range views {
		if v.Monthly > 0 {
			if err := b.alert(ctx, h, v); err != nil {
				return err
			}
		}
	}
	if b.then != nil {
		return b.then(ctx, h, views, now)
	}
	return nil
}

// WriteUsage adds what queues counted since it was last taken (publishes,
// deliveries, basic.get-oks) to broker_usage, in the hour of now; what it
// cannot write goes back to the counts. The daemon's Budget calls it every
// budgetEvery; a command that spends messages (replay, the -error peeks of
// deliveries show) calls it before it ends.
func WriteUsage(ctx context.Context, store *Store, queues *Queues, now time.Time) error {
	usage := queues.TakeUsage()
	if !spentAny(usage) {
		return nil
	}
	err := store.WriteTx(ctx, func(tx *Tx) error { return tx.AddBrokerUsage(ctx, now, usageRows(usage)) })
	if err != nil {
		queues.ReturnUsage(usage)
	}
	return err
}

// take takes what b's queues counted since it was last taken, for a batch
// of consumed messages to write in its transaction (write): a daemon at
// work writes no transaction of its own for its counts. A nil b counts
// nothing.
func (b *Usage) take() []BrokerUsage {
	if b == nil {
		return nil
	}
	return b.queues.TakeUsage()
}

// write adds counted (take) to broker_usage in tx.
func (b *Usage) write(ctx context.Context, tx *Tx, counted []BrokerUsage) error {
	if !spentAny(counted) {
		return nil
	}
	return tx.AddBrokerUsage(ctx, time.Now(), usageRows(counted))
}

// giveBack gives counted back to the counts, from a transaction that did
// not commit.
func (b *Usage) giveBack(counted []BrokerUsage) {
	if b != nil && counted != nil {
		b.queues.ReturnUsage(counted)
	}
}

// usageRows are usage as broker_usage keeps it.
func usageRows(usage []BrokerUsage) []usageRow {
	rows := make([]usageRow, 0, len(usage))
	for _, u := range usage {
		rows = append(rows, usageRow{Broker: usageKey(u.Broker.Host, u.Broker.Vhost), Published: u.Published, Delivered: u.Delivered})
	}
	return rows
}

// spentAny reports whether usage counts any message.
func spentAny(usage []BrokerUsage) bool {
	for _, u := range usage {
		if u.Published != 0 || u.Delivered != 0 {
			return true
		}
	}
	return false
}

// Views is every broker's spending this budget month as of now.
func (b *Usage) Views(ctx context.Context, now time.Time) ([]BudgetView, error) {
	var out []BudgetView
	for i, br := range b.brokers {
		key := usageKey(br.Host, br.Vhost)
		start, end := budgetMonth(now, b.cfgs[i].resetDay())
		pub, del, err := b.store.BrokerUsageSince(ctx, key, start)
		if err != nil {
			return nil, err
		}
		lastPub, lastDel, err := b.store.BrokerUsageSince(ctx, key, now.Add(-24*time.Hour))
		if err != nil {
			return nil, err
		}
		first, counted, err := b.store.BrokerUsageFirst(ctx, key)
		if err != nil {
			return nil, err
		}
		v := BudgetView{Broker: br.Index, Published: pub, Delivered: del, Monthly: b.cfgs[i].MonthlyMessages,
			MonthStart: start, MonthEnd: end}
		used := pub + del
		if !counted {
			first = now
		}
		perSecond := float64(lastPub+lastDel) / (24 * time.Hour).Seconds()
		if v.ProjectedFrom = first.Add(projectionNeeds).UTC(); !now.Before(v.ProjectedFrom) {
			projected := used + int64(perSecond*end.Sub(now).Seconds())
			v.Projected = &projected
		}
		if v.Monthly > 0 {
			v.UsedRatio = float64(used) / float64(v.Monthly)
			if v.Projected != nil && perSecond > 0 && used < v.Monthly {
				if out := now.Add(time.Duration(float64(v.Monthly-used) / perSecond * float64(time.Second))); out.Before(end) {
					v.RunsOut = out.UTC()
				}
			}
		}
		out = append(out, v)
	}
	return out, nil
}

// alertBlocks queues one alert (rule event "blocked") per block a broker
// announced (connection.blocked) that still holds at a check, every
// budgetEvery: a block lifted within seconds pages nobody. The queue logs
// each block as it begins and ends.
func (b *Usage) alertBlocks(ctx context.Context, h Holding) error {
	for _, br := range b.brokers {
		blk, blocked := b.queues.Blocked(br)
		if !blocked {
			continue
		}
		id := blockedAlertID(usageKey(br.Host, br.Vhost), blk.Since, blk.Reason)
		if _, err := queueOwnAlert(ctx, h, b.store, b.alerter, id, AlertIntent{Name: "blocked"}); err != nil {
			return err
		}
	}
	return nil
}

// queueOwnAlert queues, once, switchyard's own alert named id (a budget
// or a block, not an Event's) on the channels intent's rules name; queued
// reports whether it was new.
func queueOwnAlert(ctx context.Context, h Holding, store *Store, alerter *Alerter, id string, intent AlertIntent) (queued bool, err error) {
	err = h.WriteTx(ctx, store, func(tx *Tx) (err error) {
		queued, err = tx.QueueOwnAlert(ctx, id, alerter.ChannelsFor(intent))
		return err
	})
	return queued, err
}

// blockedAlertID names the alert of one block of broker ("HOST/VHOST").
func blockedAlertID(broker string, since time.Time, reason string) string {
	return fmt.Sprintf("blocked:%s since %s because %s", broker, since.UTC().Format(time.RFC3339Nano), reason)
}

// alert queues the budget alerts v's spending calls for, each once per
// broker and budget month.
func (b *Usage) alert(ctx context.Context, h Holding, v BudgetView) error {
	br := b.brokers[v.Broker]
	for _, level := range []struct {
		name string
		at   float64
	}{{"warn", b.warnAt}, {"exhausted", 1}} {
		if v.UsedRatio < level.at {
			continue
		}
		id := fmt.Sprintf("budget:%s:%s:%s", usageKey(br.Host, br.Vhost), v.MonthStart.Format("2006-01-02"), level.name)
		queued, err := queueOwnAlert(ctx, h, b.store, b.alerter, id, AlertIntent{Name: "budget", Action: level.name})
		if err != nil {
			return err
		}
		if queued {
			b.log.Warn("broker budget", "level", level.name, "broker", br.String(), "used", v.Published+v.Delivered,
				"monthly_messages", v.Monthly, "projected", v.ProjectionText())
		}
	}
	return nil
}
