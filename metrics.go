package main

import (
	"context"
	"math"
	"net/http"
	"regexp"
	"runtime"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Metrics are switchyard's Prometheus metrics, on a registry of their own
// (no global state). Every method is safe on a nil *Metrics, which records
// nothing: parts built without metrics (commands, tests) need no stubs.
type Metrics struct {
	reg *prometheus.Registry

	webhooks       *prometheus.CounterVec
	unrecorded     prometheus.Counter
	publishes      *prometheus.CounterVec
	publishSeconds *prometheus.HistogramVec
	webhookSeconds *prometheus.HistogramVec
	consumed       *prometheus.CounterVec
	processSeconds *prometheus.HistogramVec
	activeBroker   prometheus.Gauge
	pendingSwitch  prometheus.Gauge
	switches       *prometheus.CounterVec
	leftovers      *prometheus.CounterVec
	dbWriteSeconds prometheus.Histogram
	hcFailures     *prometheus.CounterVec
	spansDropped   prometheus.Counter
	staleEvents    *prometheus.CounterVec
	queueMessages  *prometheus.GaugeVec
	brokerUp       *prometheus.GaugeVec
	blockedBrokers *prometheus.GaugeVec
	// brokerMessageCount and budgetUsed are this budget month's spending.
	brokerMessageCount *prometheus.GaugeVec
	budgetUsed         *prometheus.GaugeVec
	brokerInfo         *prometheus.GaugeVec
	buildInfo          *prometheus.GaugeVec
	workerCycle        *prometheus.GaugeVec
	workerFailures     *prometheus.GaugeVec
}

// MetricLabels are the label values known before anything happens, so that
// their counters start at 0: rate() and increase() then see a first event.
// The owners of the names hand them in; metrics knows none of them.
type MetricLabels struct {
	Version  string   // the build's, for switchyard_build_info
	Queues   []string // the four logical queues
	Outcomes []string // how consuming a message ends
	Tables   []string // the order-safe typed tables
}

// NewMetrics registers every metric, plus the Go runtime and process ones.
func NewMetrics(labels MetricLabels) *Metrics {
	latency := []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}
	// A webhook's answer is a commit (milliseconds): finer there, up to
	// GitHub's 10 s.
	answer := []float64{.0005, .001, .002, .003, .005, .0075, .01, .015, .02, .03, .05, .1, .25, .5, 1, 2.5, 5, 10}
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		webhooks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "switchyard_webhooks_received_total",
			Help: "Webhook requests by outcome: accepted (committed to the outbox), forbidden (accepted into github-forbidden), published (the store did not take it; the broker confirmed it), unauthorized, bad_request, too_large, unavailable."},
			[]string{"outcome"}),
		unrecorded: prometheus.NewCounter(prometheus.CounterOpts{Name: "switchyard_webhook_rejections_unrecorded_total",
			Help: "Refused webhooks counted but not recorded in rejected_webhooks: over 100 a second, or the database did not take them."}),
		webhookSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "switchyard_webhook_duration_seconds",
			Help: "Time from a webhook request's arrival to its answer written, by outcome (as switchyard_webhooks_received_total).", Buckets: answer}, []string{"outcome"}),
		publishes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "switchyard_publishes_total",
			Help: "Messages published with a publisher confirm, by broker index and outcome (confirmed, failed)."},
			[]string{"broker", "outcome"}),
		publishSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "switchyard_publish_duration_seconds",
			Help: "Time from publish to publisher confirm, by broker index.", Buckets: latency}, []string{"broker"}),
		consumed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "switchyard_messages_consumed_total",
			Help: "Messages consumed, by queue and outcome (done, duplicate, retry, error)."}, []string{"queue", "outcome"}),
		processSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "switchyard_message_processing_seconds",
			Help: "Time to process one message up to its ack, by queue.", Buckets: latency}, []string{"queue"}),
		activeBroker: prometheus.NewGauge(prometheus.GaugeOpts{Name: "switchyard_active_broker_index",
			Help: "Index of the broker the workers read."}),
		pendingSwitch: prometheus.NewGauge(prometheus.GaugeOpts{Name: "switchyard_pending_switch",
			Help: "1 while a Pending Switch waits for the active broker to drain, else 0."}),
		switches: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "switchyard_switches_completed_total",
			Help: "Completed broker switches, by reason (drained, operator)."}, []string{"reason"}),
		leftovers: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "switchyard_leftover_messages_drained_total",
			Help: "Messages taken by the Leftover Drain from non-active brokers, by queue."}, []string{"queue"}),
		dbWriteSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "switchyard_database_write_seconds",
			Help: "Duration of one SQLite write transaction, from begin to commit.", Buckets: latency}),
		spansDropped: prometheus.NewCounter(prometheus.CounterOpts{Name: "switchyard_tracing_spans_dropped_total",
			Help: "Spans lost, not exported: the collector did not take them (down, refusing, or past the export's time), or it was slower than the spans came and the bounded queue of spans waiting for it was full."}),
		hcFailures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "switchyard_healthchecks_failures_total",
			Help: "HealthChecks pings that failed, by worker."}, []string{"worker"}),
		staleEvents: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "switchyard_stale_events_total",
			Help: "Events older than the typed row they map to, which kept the row as it was, by table."}, []string{"table"}),
		queueMessages: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "switchyard_queue_messages",
			Help: "Ready messages of each of the 12 queues on every broker (-error included), as the last passive declare saw them: the fleet check reads them all every 60 s; absent while a broker cannot be read."},
			[]string{"broker", "queue"}),
		brokerMessageCount: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "switchyard_broker_messages",
			Help: "Messages switchyard published to (kind published) and had delivered from (kind delivered) each broker this budget month: what a plan's monthly quota counts."},
			[]string{"broker", "kind"}),
		budgetUsed: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "switchyard_broker_budget_used_ratio",
			Help: "The share of the broker's monthly_messages spent this budget month; 0 without a quota."}, []string{"broker"}),
		blockedBrokers: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "switchyard_broker_blocked",
			Help: "1 while the broker blocks switchyard's connection (connection.blocked: a resource alarm or a quota), else 0."}, []string{"broker"}),
		brokerUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "switchyard_broker_up",
			Help: "1 when the broker answered the last keepalive or depth check, else 0."}, []string{"broker"}),
		brokerInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "switchyard_broker_info",
			Help: "Always 1: the host and vhost of each configured broker index."}, []string{"broker", "host", "vhost"}),
		buildInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "switchyard_build_info",
			Help: "Always 1: the version of switchyard and of Go it was built with."}, []string{"version", "goversion"}),
		workerCycle: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "switchyard_worker_last_cycle_timestamp_seconds",
			Help: "When the worker was last known well (Unix time): its consumer attached, or a cycle ended well; 0 before the first."}, []string{"worker"}),
		workerFailures: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "switchyard_worker_failures",
			Help: "Cycles the worker failed in a row; 0 once its consumer attaches again or a cycle ends well."}, []string{"worker"}),
	}
	m.reg.MustRegister(m.spansDropped)
	m.reg.MustRegister(m.webhooks, m.webhookSeconds, m.unrecorded, m.publishes, m.publishSeconds, m.consumed, m.processSeconds,
		m.activeBroker, m.pendingSwitch, m.switches, m.leftovers, m.dbWriteSeconds, m.hcFailures,
		m.staleEvents, m.queueMessages, m.brokerUp, m.blockedBrokers, m.brokerMessageCount, m.budgetUsed, m.brokerInfo, m.buildInfo, m.workerCycle, m.workerFailures,
		// Beside the defaults, the collector's share of the CPU
		// (go_cpu_classes_gc_total_cpu_seconds_total): against the
		// process's, what collecting costs a webhook.
		collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(
			collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(`^/cpu/classes/gc/total:cpu-seconds$`)})),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.buildInfo.WithLabelValues(labels.Version, runtime.Version()).Set(1)
	// Counters whose label values are known start at 0, so that rate() and
	// increase() see their first event.
	for _, o := range []string{"accepted", "forbidden", "published", "unauthorized", "bad_request", "too_large", "unavailable"} {
		m.webhooks.WithLabelValues(o)
	}
	for _, q := range labels.Queues {
		m.leftovers.WithLabelValues(q)
		for _, o := range labels.Outcomes {
			m.consumed.WithLabelValues(q, o)
		}
	}
	for _, r := range []string{"drained", "operator"} {
		m.switches.WithLabelValues(r)
	}
	for _, t := range labels.Tables {
		m.staleEvents.WithLabelValues(t)
	}
	return m
}

// broker records one configured broker: its info, and its publish
// counters at 0.
func (m *Metrics) broker(index int, host, vhost string) {
	if m == nil {
		return
	}
	i := strconv.Itoa(index)
	m.brokerInfo.WithLabelValues(i, host, vhost).Set(1)
	m.blockedBrokers.WithLabelValues(i).Set(0)
	m.publishes.WithLabelValues(i, "confirmed")
	m.publishes.WithLabelValues(i, "failed")
}

// brokerSeen records whether broker b answered the fleet check (its depths
// were recorded by the passive declares, see ready); a broker that did not
// answer loses its depth series rather than showing stale ones.
func (m *Metrics) brokerSeen(index int, err error) {
	if m == nil {
		return
	}
	i := strconv.Itoa(index)
	if err != nil {
		m.brokerUp.WithLabelValues(i).Set(0)
		m.queueMessages.DeletePartialMatch(prometheus.Labels{"broker": i})
		return
	}
	m.brokerUp.WithLabelValues(i).Set(1)
}

// worker records a registered worker: its gauges and its HealthChecks
// failures at 0 until its first cycle.
func (m *Metrics) worker(name string) {
	if m != nil {
		m.workerCycle.WithLabelValues(name)
		m.workerFailures.WithLabelValues(name)
		m.hcFailures.WithLabelValues(name)
	}
}

// cycle records how one cycle of worker ended.
func (m *Metrics) cycle(worker string, failures int, at time.Time) {
	if m == nil {
		return
	}
	m.workerFailures.WithLabelValues(worker).Set(float64(failures))
	if failures == 0 {
		m.workerCycle.WithLabelValues(worker).Set(float64(at.UnixNano()) / 1e9)
	}
}

func (m *Metrics) staleEvent(table string) {
	if m != nil {
		m.staleEvents.WithLabelValues(table).Inc()
	}
}

// Handler serves the registry in the Prometheus text format, or in
// OpenMetrics (which carries the exemplars) to a scraper that asks for it.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{EnableOpenMetrics: true})
}

// SpansDropped counts n spans lost: dropped by the tracing queue, or not
// taken by the collector.
func (m *Metrics) SpansDropped(n int) {
	if m != nil {
		m.spansDropped.Add(float64(n))
	}
}

// webhook counts a webhook request by its outcome, and observes how long
// its answer took, with the trace ID of its delivery's trace (when
// traced) as the observation's exemplar.
func (m *Metrics) webhook(outcome, traceID string, took time.Duration) {
	if m == nil {
		return
	}
	m.webhooks.WithLabelValues(outcome).Inc()
	if traceID != "" {
		m.webhookSeconds.WithLabelValues(outcome).(prometheus.ExemplarObserver).ObserveWithExemplar(took.Seconds(), prometheus.Labels{"trace_id": traceID})
		return
	}
	m.webhookSeconds.WithLabelValues(outcome).Observe(took.Seconds())
}

func (m *Metrics) rejectionsUnrecorded(n int64) {
	if m != nil {
		m.unrecorded.Add(float64(n))
	}
}

// publish counts a publish to broker, and observes how long its confirm
// took, with the trace ID of its delivery's trace (when traced) as the
// observation's exemplar.
func (m *Metrics) publish(broker int, traceID string, err error, took time.Duration) {
	if m == nil {
		return
	}
	b := strconv.Itoa(broker)
	outcome := "confirmed"
	switch {
	case err != nil:
		outcome = "failed"
	case traceID != "":
		m.publishSeconds.WithLabelValues(b).(prometheus.ExemplarObserver).ObserveWithExemplar(took.Seconds(), prometheus.Labels{"trace_id": traceID})
	default:
		m.publishSeconds.WithLabelValues(b).Observe(took.Seconds())
	}
	m.publishes.WithLabelValues(b, outcome).Inc()
}

func (m *Metrics) messageEnded(queue, outcome string, took time.Duration) {
	if m != nil {
		m.consumed.WithLabelValues(queue, outcome).Inc()
		m.processSeconds.WithLabelValues(queue).Observe(took.Seconds())
	}
}

func (m *Metrics) ready(broker int, queue string, n int) {
	if m != nil {
		m.queueMessages.WithLabelValues(strconv.Itoa(broker), queue).Set(float64(n))
	}
}

func (m *Metrics) brokerState(active int, pending bool) {
	if m == nil {
		return
	}
	m.activeBroker.Set(float64(active))
	if pending {
		m.pendingSwitch.Set(1)
	} else {
		m.pendingSwitch.Set(0)
	}
}

func (m *Metrics) brokerBlocked(broker int, blocked bool) {
	if m == nil {
		return
	}
	v := 0.0
	if blocked {
		v = 1
	}
	m.blockedBrokers.WithLabelValues(strconv.Itoa(broker)).Set(v)
}

// brokerMessages records what a broker cost this budget month, and the
// share of its monthly_messages (0 without a quota).
func (m *Metrics) brokerMessages(broker int, published, delivered int64, ratio float64) {
	if m == nil {
		return
	}
	i := strconv.Itoa(broker)
	m.brokerMessageCount.WithLabelValues(i, "published").Set(float64(published))
	m.brokerMessageCount.WithLabelValues(i, "delivered").Set(float64(delivered))
	m.budgetUsed.WithLabelValues(i).Set(ratio)
}

func (m *Metrics) switched(reason string) {
	if m != nil {
		m.switches.WithLabelValues(reason).Inc()
	}
}

func (m *Metrics) leftover(queue string, n int) {
	if m != nil && n > 0 {
		m.leftovers.WithLabelValues(queue).Add(float64(n))
	}
}

func (m *Metrics) dbWrite(took time.Duration) {
	if m != nil {
		m.dbWriteSeconds.Observe(took.Seconds())
	}
}

// LeaseHeld registers switchyard_lease_held for job, 1 while held says
// this node holds the lease at the moment it is scraped: a holder paused
// past its lease reads 0 the moment it resumes, not at its next renewal.
// The lease's keeper, its owner, registers it.
func (m *Metrics) LeaseHeld(job string, held func() bool) {
	if m == nil {
		return
	}
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "switchyard_lease_held",
		Help:        "1 while this node holds the job's lease: it runs the job, and no other node does.",
		ConstLabels: prometheus.Labels{"job": job}}, func() float64 {
		if held() {
			return 1
		}
		return 0
	}))
}

func (m *Metrics) healthCheckFailed(worker string) {
	if m != nil {
		m.hcFailures.WithLabelValues(worker).Inc()
	}
}

// GaugesFunc registers a gauge of one label whose series read gives at
// each scrape, a value by the label's value. The owner of what is
// measured registers it.
func (m *Metrics) GaugesFunc(name, help, label string, read func() map[string]float64) {
	m.reg.MustRegister(gaugesFunc{desc: prometheus.NewDesc(name, help, []string{label}, nil), read: read})
}

// gaugesFunc is GaugesFunc's collector.
type gaugesFunc struct {
	desc *prometheus.Desc
	read func() map[string]float64
}

func (g gaugesFunc) Describe(ch chan<- *prometheus.Desc) { ch <- g.desc }

func (g gaugesFunc) Collect(ch chan<- prometheus.Metric) {
	for k, v := range g.read() {
		ch <- prometheus.MustNewConstMetric(g.desc, prometheus.GaugeValue, v, k)
	}
}

// GaugeFunc registers a gauge that count reads at each scrape (NaN when it
// cannot). The owner of what is counted registers it: metrics only receive.
func (m *Metrics) GaugeFunc(name, help string, count func(ctx context.Context) (int, error)) {
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		n, err := count(ctx)
		if err != nil {
			return math.NaN()
		}
		return float64(n)
	}))
}
