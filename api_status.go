package main

import (
	"context"
	"crypto/subtle"
	_ "embed"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/julienschmidt/httprouter"
)

// statusTimeout bounds the status's look at the brokers, each on its own:
// one that does not answer must not hold the page.
const statusTimeout = 3 * time.Second

// Status is what an operator wants at a glance: GET /status
// renders it, GET /api/v1/status and `switchyard status -json` return it.
type Status struct {
	Version   string    `json:"version"`
	GoVersion string    `json:"go_version"`
	StartedAt time.Time `json:"started_at"`
	Now       time.Time `json:"now"`

	Active    int          `json:"active"`
	Pending   *PendingHold `json:"pending_switch"`
	Watermark *time.Time   `json:"watermark"`
	Last      *LastSwitch  `json:"last_switch"`

	Brokers []BrokerView `json:"brokers"`
	// ErrorMessages is what every -error queue of every broker that answered
	// holds in all.
	ErrorMessages int `json:"error_messages"`

	Workers    []WorkerState      `json:"workers"`
	Statistics []StatisticsBucket `json:"statistics"` // the last 7 days, 6 hours a bucket
	Database   DatabaseStatus     `json:"database"`
	// Gaps are the newest open gaps, at most statusGaps of them, and
	// GapsTotal how many are open in all (Unrecoverable of them given up
	// on): the page stays small whatever the database holds.
	Gaps          []deliveryGap `json:"open_gaps"`
	GapsTotal     int           `json:"open_gaps_total"`
	Unrecoverable int           `json:"unrecoverable_gaps"`
	// Ledgers are the hooks whose deliveries the hooks worker keeps
	// account of (the App's, repositories' and organizations' webhooks).
	Ledgers []LedgerView `json:"ledgers"`

	// Budgets are the brokers' spending this budget month.
	Budgets []BudgetView `json:"budgets"`

	// Outbox is what waits in the outbox for the broker, and what the
	// broker refused for good.
	Outbox OutboxView `json:"outbox"`
	// Refused are the webhooks of the last hour refused (4xx, 5xx), by
	// reason.
	Refused []ReasonCount `json:"refused_last_hour"`

	// Certificates are the certificates this node serves HTTPS with
	// (server.tls), absent without.
	Certificates []CertificateView `json:"certificates,omitempty"`

	// Draining is set once this node, told to stop, drains
	// (server.drain_delay): /readyz answers 503 and a balancer sends
	// webhooks elsewhere.
	Draining bool `json:"draining"`
	// Upgrade says why this node must be upgraded: the database's schema
	// floor rose above its version, and it stopped consuming.
	Upgrade string `json:"upgrade,omitempty"`

	// Node is this node's name; Nodes every node sharing the database
	// (on SQLite, this one), Leases who holds each once-only job.
	Node   string      `json:"node"`
	Nodes  []NodeView  `json:"nodes"`
	Leases []LeaseView `json:"leases"`
	// LeaseTTL is server.lease_ttl: a job with no live holder for twice
	// it is a problem.
	LeaseTTL time.Duration `json:"-"`
	// Jobs are the once-only jobs this configuration runs.
	Jobs []string `json:"-"`

	// Problems names each thing that needs the operator, [] when all is
	// well: `switchyard status` exits 1 when there is one.
	Problems []string `json:"problems"`
}

// ownLeasesNow makes what st says of this node's leases what Leases.Holds
// says now: the table says what the last renewal wrote, and a node paused
// past its leases (a frozen VM) holds none the moment it resumes.
func (a *API) ownLeasesNow(st *Status) {
	held := a.leases.Holds
	for i, l := range st.Leases {
		if l.Node == st.Node && l.Live && !held(l.Job) {
			st.Leases[i].Live = false
		}
	}
	for i, n := range st.Nodes {
		if n.Name == st.Node {
			st.Nodes[i].Leases = slices.DeleteFunc(slices.Clone(n.Leases), func(job string) bool { return !held(job) })
		}
	}
}

// OutboxView is the outbox as the status shows it: what the store holds,
// and this node's bound.
type OutboxView struct {
	OutboxState
	// Waiting is the bytes of this node's rows that wait, against
	// MaxBytes; Full once they reach it (webhooks take the broker's path).
	Waiting  int64 `json:"node_waiting_bytes"`
	MaxBytes int64 `json:"max_bytes"`
	Full     bool  `json:"full"`
}

// outboxTooOld is how long webhooks may wait in the outbox before the
// status calls it a problem (the alert rule's threshold too).
const outboxTooOld = 10 * time.Minute

// statusGaps is the most gaps the status lists.
const statusGaps = 100

// pendingTooLong is how long a Pending Switch may wait for its drain before
// the status calls it a problem (the alert rule's threshold too).
const pendingTooLong = time.Hour

// problems names what needs the operator in st, each on its own.
func (st *Status) problems() []string {
	ps := []string{}
	if st.Upgrade != "" {
		ps = append(ps, "this node stopped consuming, upgrade it: "+st.Upgrade)
	}
	for _, b := range st.Brokers {
		switch {
		case !b.Up && b.Problem != "":
			ps = append(ps, fmt.Sprintf("broker #%d (%s vhost %s) %s: %s", b.Index, b.Host, b.Vhost, b.Problem, b.Error))
		case !b.Up:
			ps = append(ps, fmt.Sprintf("broker #%d (%s vhost %s) is down: %s", b.Index, b.Host, b.Vhost, b.Error))
		case b.Blocked != "":
			ps = append(ps, fmt.Sprintf("broker #%d (%s vhost %s) %s since %s: %s; webhooks sent to it answer 503",
				b.Index, b.Host, b.Vhost, b.Problem, b.BlockedSince.Format(time.RFC3339), b.Blocked))
		case len(b.Missing) > 0:
			ps = append(ps, fmt.Sprintf("broker #%d (%s vhost %s) lacks %s", b.Index, b.Host, b.Vhost, strings.Join(b.Missing, ", ")))
		}
		for _, q := range logicalQueues {
			if n := b.Queues[errorQueue(q)].Ready; n > 0 {
				ps = append(ps, fmt.Sprintf("%s on broker #%d holds %s (switchyard replay %s)", errorQueue(q), b.Index, plural(n, "message"), q))
			}
		}
	}
	for _, v := range st.Budgets {
		switch {
		case v.Monthly > 0 && v.UsedRatio >= 1:
			ps = append(ps, fmt.Sprintf("broker #%d has spent its monthly_messages (%d of %d) until %s", v.Broker,
				v.Published+v.Delivered, v.Monthly, v.MonthEnd.Format("2006-01-02")))
		case !v.RunsOut.IsZero():
			ps = append(ps, fmt.Sprintf("broker #%d runs out of its monthly_messages on %s at the last 24 hours' rate (projected %s of %d)",
				v.Broker, v.RunsOut.Format("2006-01-02"), v.ProjectionText(), v.Monthly))
		}
	}
	if p := st.Pending; p != nil && st.Now.Sub(p.RecordedAt) > pendingTooLong {
		ps = append(ps, fmt.Sprintf("the pending switch to broker #%d has waited %s for the drain", p.Index, st.Now.Sub(p.RecordedAt).Round(time.Minute)))
	}
	for _, w := range st.Workers {
		if w.Failures > 0 {
			ps = append(ps, fmt.Sprintf("worker %s failed its last %s: %s", w.Name, plural(w.Failures, "cycle"), w.LastError))
		}
	}
	for _, job := range st.Jobs {
		i := slices.IndexFunc(st.Leases, func(l LeaseView) bool { return l.Job == job })
		switch {
		case i < 0 && st.Now.Sub(st.StartedAt) > 2*st.LeaseTTL:
			ps = append(ps, fmt.Sprintf("job %s has no node holding its lease", job))
		case i >= 0 && !st.Leases[i].Live && st.Leases[i].Orphaned > 2*st.LeaseTTL:
			ps = append(ps, fmt.Sprintf("job %s has had no live holder for %s (last held by node %s)", job, st.Leases[i].Orphaned, st.Leases[i].Node))
		}
	}
	if ob := st.Outbox; ob.Messages > 0 && ob.Oldest != nil && st.Now.Sub(*ob.Oldest) > outboxTooOld {
		ps = append(ps, fmt.Sprintf("the outbox has held %s since %s: the broker does not take them", plural(int(ob.Messages), "webhook"),
			ob.Oldest.Format(time.RFC3339)))
	}
	if n := st.Outbox.RefusedCount; n > 0 {
		ps = append(ps, fmt.Sprintf("the broker refused %s in the outbox for good (%s): raise its limit, then switchyard outbox retry",
			plural(int(n), "webhook"), st.Outbox.Refused[0].Reason))
	}
	for _, c := range st.Certificates {
		if left := c.NotAfter.Sub(st.Now); c.Overdue(st.Now) {
			ps = append(ps, fmt.Sprintf("the certificate for %s expires %s (in %s) and has not been renewed", strings.Join(c.Names, ", "),
				c.NotAfter.Format(time.RFC3339), left.Round(time.Minute)))
		}
	}
	if ob := st.Outbox; ob.Full {
		ps = append(ps, fmt.Sprintf("this node's outbox is full (%d of queue.outbox_max_bytes %d): webhooks are published to the broker directly, and answer 503 when it does not confirm",
			ob.Waiting, ob.MaxBytes))
	}
	for _, r := range st.Refused {
		if r.Status >= 500 {
			ps = append(ps, fmt.Sprintf("%s refused with %d in the last hour: %s (GitHub does not retry them)", plural(r.Count, "webhook"), r.Status, r.Reason))
		}
	}
	for _, l := range st.Ledgers {
		if l.Refused != "" {
			ps = append(ps, fmt.Sprintf("GitHub refuses the delivery ledger of %s since %s: %s; its failed deliveries are not replayed "+
				"until it answers (check the hook's token and ID)", l.Name, l.RefusedSince.UTC().Format(time.RFC3339), l.Refused))
		}
	}
	if n := st.GapsTotal; n > 0 {
		p := fmt.Sprintf("%s open (switchyard deliveries -gaps)", plural(n, "delivery gap"))
		if st.Unrecoverable > 0 {
			p += fmt.Sprintf(", %d of them unrecoverable: GitHub will not deliver them again", st.Unrecoverable)
		}
		ps = append(ps, p)
	}
	return ps
}

// plural is n and the noun, with an s when n is not 1.
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// PendingHold is a Pending Switch and what holds it: the consumed queues of
// the active broker that still hold messages.
type PendingHold struct {
	PendingSwitch
	HeldBy []QueueHold `json:"held_by"`
}

// QueueHold is one queue on one broker that a Pending Switch waits for.
type QueueHold struct {
	Broker   int    `json:"broker"`
	Queue    string `json:"queue"`
	Messages int    `json:"messages"`
}

// BrokerView is one configured broker as the status sees it now.
type BrokerView struct {
	Index   int    `json:"index"`
	Host    string `json:"host"`
	Vhost   string `json:"vhost"`
	Active  bool   `json:"active"`
	Pending bool   `json:"pending"` // a Pending Switch's target
	Up      bool   `json:"up"`
	Error   string `json:"error,omitempty"`
	// Blocked is the broker's reason while it blocks switchyard's
	// connection (connection.blocked), and BlockedSince since when.
	Blocked      string    `json:"blocked,omitempty"`
	BlockedSince time.Time `json:"blocked_since,omitzero"`
	// Problem is what is wrong with the broker in a public answer's words
	// ("blocked", "refusing publishes", "refuses access", ...), "" when
	// nothing is; Error and Blocked say why, for the operator.
	Problem string               `json:"problem,omitempty"`
	Missing []string             `json:"missing_queues,omitempty"`
	Queues  map[string]queueInfo `json:"queues,omitempty"`
}

// Role is what the broker is to the workers: "active", "pending target" or
// "-".
func (b BrokerView) Role() string {
	switch {
	case b.Active:
		return "active"
	case b.Pending:
		return "pending target"
	}
	return "-"
}

// ErrorDepth is what the broker's -error queues hold.
func (b BrokerView) ErrorDepth() int {
	n := 0
	for _, q := range logicalQueues {
		n += b.Queues[errorQueue(q)].Ready
	}
	return n
}

// gatherStatus gathers the Status: the state machine, every broker at once (each
// within statusTimeout), the workers, and the database.
func (a *API) gatherStatus(ctx context.Context) (Status, error) {
	st := Status{Version: version, GoVersion: runtime.Version(), StartedAt: a.started, Now: time.Now().UTC(),
		Draining: a.draining.Load()}
	sw, err := a.brokers.State(ctx)
	if err != nil {
		return st, err
	}
	st.Active, st.Last = sw.Active, sw.Last
	if !sw.Watermark.IsZero() {
		st.Watermark = &sw.Watermark
	}
	list := a.brokers.List()
	st.Brokers = make([]BrokerView, len(list))
	var wg sync.WaitGroup
	for i, b := range list {
		bs := BrokerView{Index: b.Index, Host: b.Host, Vhost: b.Vhost, Active: b.Index == sw.Active,
			Pending: sw.Pending != nil && sw.Pending.Index == b.Index}
		if blk, ok := a.queues.Blocked(b); ok {
			bs.Blocked, bs.BlockedSince = blk.Reason, blk.Since
			bs.Problem = brokerProblem(blk.Kind)
		}
		wg.Go(func() {
			bctx, cancel := context.WithTimeout(ctx, statusTimeout)
			defer cancel()
			// A stalled broker holds a call for call_timeout: the page
			// does not wait for it, the call ends on its own.
			type result struct {
				queues  map[string]queueInfo
				missing []string
				err     error
			}
			done := make(chan result, 1)
			a.inspections.Go(func() {
				queues, missing, err := a.queues.Inspect(bctx, b)
				done <- result{queues, missing, err}
			})
			select {
			case r := <-done:
				if r.err != nil {
					bs.Error = r.err.Error()
					if errors.Is(r.err, ErrBrokerAccessRefused) {
						bs.Problem = brokerProblem(r.err)
					}
				} else {
					bs.Up, bs.Queues, bs.Missing = true, r.queues, r.missing
				}
			case <-bctx.Done():
				bs.Error = fmt.Sprintf("no answer within %s", statusTimeout)
			}
			st.Brokers[i] = bs
		})
	}
	wg.Wait()
	for _, b := range st.Brokers {
		st.ErrorMessages += b.ErrorDepth()
	}
	if sw.Pending != nil {
		st.Pending = &PendingHold{PendingSwitch: *sw.Pending, HeldBy: []QueueHold{}}
		active := st.Brokers[sw.Active]
		for _, q := range consumedQueues(a.cfg) {
			for _, name := range []string{q, retryQueue(q)} {
				if n := active.Queues[name].Ready; n > 0 {
					st.Pending.HeldBy = append(st.Pending.HeldBy, QueueHold{Broker: sw.Active, Queue: name, Messages: n})
				}
			}
		}
	}
	for _, w := range a.workers {
		st.Workers = append(st.Workers, w.State())
	}
	db, err := a.store.Status(ctx, st.Now.Add(-7*24*time.Hour), st.Now, statusGaps)
	if err != nil {
		return st, err
	}
	st.Statistics, st.Database, st.Gaps, st.GapsTotal, st.Unrecoverable = db.Statistics, db.Database, db.Gaps, db.GapsTotal, db.Unrecoverable
	st.Refused = db.Refused
	st.Ledgers = []LedgerView{}
	if a.hooks != nil {
		if st.Ledgers, err = a.hooks.Views(ctx); err != nil {
			return st, err
		}
	}
	ob := a.webhook.outbox
	state, err := ob.State(ctx)
	if err != nil {
		return st, err
	}
	st.Outbox = OutboxView{OutboxState: state, Waiting: ob.Waiting(), MaxBytes: ob.MaxBytes(), Full: ob.Full()}
	if a.certificates != nil {
		st.Certificates = a.certificates()
	}
	if down, _, cause := a.store.Down(); down && errors.Is(cause, ErrSchemaFloor) {
		st.Upgrade = cause.Error()
	}
	st.Node, st.LeaseTTL, st.Jobs = a.cfg.Server.NodeName, a.cfg.Server.LeaseTTL, leaseJobs(a.cfg)
	if st.Nodes, st.Leases, err = a.store.Cluster(ctx, a.cfg.Server.LeaseTTL); err != nil {
		return st, err
	}
	a.ownLeasesNow(&st)
	if a.usage != nil {
		if st.Budgets, err = a.usage.Views(ctx, st.Now); err != nil {
			return st, err
		}
	}
	st.Problems = st.problems()
	return st, nil
}

// getStatus is GET /api/v1/status.
func (a *API) getStatus(w http.ResponseWriter, r *http.Request, _ httprouter.Params) {
	st, err := a.gatherStatus(r.Context())
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	writeJSON(w, http.StatusOK, st)
}

// statusPage is GET /status: the Status as one HTML page, behind HTTP Basic
// auth (user "operator", the operator token as password), so that a browser
// can ask for it.
func (a *API) statusPage(w http.ResponseWriter, r *http.Request, ps httprouter.Params) {
	a.operatorPage(a.renderStatus)(w, r, ps)
}

// operatorPage lets the operator's browser in: HTTP Basic auth, user
// "operator" and the operator token as password.
func (a *API) operatorPage(h httprouter.Handle) httprouter.Handle {
	return func(w http.ResponseWriter, r *http.Request, ps httprouter.Params) {
		user, pass, ok := r.BasicAuth()
		if !ok || subtle.ConstantTimeCompare([]byte(user), []byte("operator")) != 1 || !tokenIs(pass, a.tokens.Load().OperatorToken) {
			if ok {
				// A browser asks without credentials first: only a wrong
				// password is a failed authentication.
				a.authFailed(r)
			}
			w.Header().Set("WWW-Authenticate", `Basic realm="switchyard", charset="UTF-8"`)
			writeError(w, r, a.log, ErrPageUnauthorized)
			return
		}
		a.bounded(h)(w, r, ps)
	}
}

// renderStatus writes the status page for a request already let in.
func (a *API) renderStatus(w http.ResponseWriter, r *http.Request, _ httprouter.Params) {
	st, err := a.gatherStatus(r.Context())
	if err != nil {
		writeError(w, r, a.log, err)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if err := statusTemplate.Execute(w, st); err != nil {
		a.log.Warn("status page", "error", err)
	}
}

//go:embed api_status.html
var statusHTML string

var statusTemplate = template.Must(template.New("status").Funcs(template.FuncMap{
	"ago":           ago,
	"lastCycle":     lastCycle,
	"forbiddenRead": forbiddenRead,
	"plural":        plural,
	"plural64":      func(n int64, noun string) string { return plural(int(n), noun) },
	"percent":       func(r float64) string { return fmt.Sprintf("%.1f %%", 100*r) },
	"when":          pageFuncs["when"],
	"bytes": func(n int64) string {
		switch {
		case n >= 1<<30:
			return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
		case n >= 1<<20:
			return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
		}
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	},
	"queueNames": func() []string { return allQueues() },
	"isError":    func(name string) bool { return strings.HasSuffix(name, "-error") },
	"chart":      statisticsChart,
	"sortedRows": func(rows map[string]int) []string {
		keys := make([]string, 0, len(rows))
		for k := range rows {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		return keys
	},
}).Parse(statusHTML))

// ago says how long before now t was, to the second; "never" for no time.
func ago(now, t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return max(now.Sub(t).Round(time.Second), 0).String() + " ago"
}

// lastCycle says when a worker's last cycle ended well, or, before its
// first, when its window or pause ends: a worker in its first window is
// not stuck.
func lastCycle(now time.Time, w WorkerState) string {
	switch {
	case !w.LastCycle.IsZero():
		return ago(now, w.LastCycle)
	case !w.WindowEnds.IsZero():
		return "first window ends in " + until(now, w.WindowEnds)
	case !w.NextCycle.IsZero():
		return "next cycle in " + until(now, w.NextCycle)
	}
	return "starting"
}

// until says how long after now t is, to the second.
func until(now, t time.Time) string {
	return max(t.Sub(now).Round(time.Second), 0).String()
}

// forbiddenRead says when github-forbidden is read next: now, until the
// cleanup worker's window ends, or when its next cycle starts. "" when no
// worker reads it.
func forbiddenRead(now time.Time, workers []WorkerState) string {
	for _, w := range workers {
		if w.Queue != queueForbidden {
			continue
		}
		switch {
		case !w.WindowEnds.IsZero():
			return "being read now (its window ends in " + until(now, w.WindowEnds) + ")"
		case !w.NextCycle.IsZero():
			return "next read in " + until(now, w.NextCycle)
		}
		return "read at the next cycle"
	}
	return ""
}

// statisticsChart draws the 6-hour buckets as an inline SVG bar chart, one
// bar per bucket, with the largest bucket's count and the span as labels.
func statisticsChart(buckets []StatisticsBucket) template.HTML {
	const w, h, top = 560.0, 120.0, 14.0
	peak := 1
	total := 0
	for _, b := range buckets {
		peak = max(peak, b.Count)
		total += b.Count
	}
	var s strings.Builder
	fmt.Fprintf(&s, `<svg class="chart" viewBox="0 0 %.0f %.0f" role="img" aria-label="Events per 6 hours, last 7 days: %d in all">`, w, h+16, total)
	if n := len(buckets); n > 0 {
		bw := w / float64(n)
		for i, b := range buckets {
			bh := (h - top) * float64(b.Count) / float64(peak)
			fmt.Fprintf(&s, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f"><title>%s: %d</title></rect>`,
				float64(i)*bw+1, h-bh, bw-2, bh, b.Start.Format("Mon 02 Jan 15:04"), b.Count)
		}
		fmt.Fprintf(&s, `<text x="0" y="10">peak %d per 6 h</text>`, peak)
		fmt.Fprintf(&s, `<text x="0" y="%.0f">%s</text>`, h+14, buckets[0].Start.Format("Mon 02 Jan"))
		fmt.Fprintf(&s, `<text x="%.0f" y="%.0f" text-anchor="end">now</text>`, w, h+14)
	}
	s.WriteString(`</svg>`)
	return template.HTML(s.String()) // built here from numbers and fixed formats only
}
