package main

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

// HealthChecks sends the workers' HealthChecks pings, as the job of the
// healthchecks lease (Run): of the nodes sharing a database, only its
// holder pings, so that one node's cycles tell. Each worker's HealthCheck
// hands its pings over without waiting; the sender drops those made
// before it took its holding, and any while it no longer holds it.
type HealthChecks struct {
	pings   chan ping
	log     *slog.Logger
	metrics *Metrics
}

// ping is one ping a worker's cycle made: to url+suffix, with body, at at.
type ping struct {
	worker, url, suffix, body string
	at                        time.Time
}

// pingBacklog bounds the pings waiting for the sender: a worker never
// waits on HealthChecks; past it, a ping is dropped.
const pingBacklog = 64

// NewHealthChecks makes the pings' sender.
func NewHealthChecks(metrics *Metrics, log *slog.Logger) *HealthChecks {
	return &HealthChecks{pings: make(chan ping, pingBacklog), log: log, metrics: metrics}
}

// For is worker's HealthCheck, pinging url ("" pings nothing).
func (hs *HealthChecks) For(url, worker string) *HealthCheck {
	h := &HealthCheck{worker: worker, to: hs, log: hs.log.With("worker", worker)}
	h.SetURL(url)
	return h
}

// Run sends the pings, in the order they were made, under held: until ctx
// ends, each made since held was taken, while held still holds, right
// before it is sent, given up once it no longer does (Within), and
// through connections that write nothing once it no longer does (Guard).
func (hs *HealthChecks) Run(ctx context.Context, held Holding) error {
	since := held.Since()
	client := pingClient(held)
	defer client.CloseIdleConnections()
	for {
		select {
		case <-ctx.Done():
			return nil
		case p := <-hs.pings:
			if p.at.Before(since) || !held.Held() {
				continue
			}
			sendCtx, cancel := held.Within(ctx)
			hs.send(sendCtx, client, p)
			cancel()
		}
	}
}

// pingClient is the pings' client under held: its connections, the
// holding's own, write only while it holds.
func pingClient(held Holding) *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	dial := t.DialContext
	t.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return held.Guard(c), nil
	}
	return &http.Client{Transport: t, Timeout: 10 * time.Second}
}

// send sends p through client; a ping that fails is logged and counted.
func (hs *HealthChecks) send(ctx context.Context, client *http.Client, p ping) {
	log := hs.log.With("worker", p.worker)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url+p.suffix, strings.NewReader(p.body))
	if err != nil {
		log.Warn("healthchecks ping not sent", "error", err)
		return
	}
	req.Header.Set("Content-Type", "text/plain; charset=utf-8")
	resp, err := client.Do(req)
	if err != nil {
		// The URL is a secret of sorts: log the host only.
		hs.metrics.healthCheckFailed(p.worker)
		log.Warn("healthchecks ping failed", "host", req.URL.Host, "ping", strings.TrimPrefix(p.suffix, "/"), "error", redactURLError(err))
		return
	}
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		hs.metrics.healthCheckFailed(p.worker)
		log.Warn("healthchecks ping refused", "host", req.URL.Host, "ping", strings.TrimPrefix(p.suffix, "/"), "status", resp.StatusCode)
	}
}

// HealthCheck is one worker's pings: /start when a cycle begins, the URL
// itself when it succeeds, /fail with a short reason when it fails, each
// handed to the HealthChecks sender. A nil *HealthCheck pings nothing.
type HealthCheck struct {
	url    atomic.Pointer[string] // "" pings nothing; a SIGHUP may change it
	worker string
	to     *HealthChecks
	log    *slog.Logger
}

// SetURL changes the ping URL (SIGHUP); "" stops the pings.
func (h *HealthCheck) SetURL(url string) {
	url = strings.TrimRight(url, "/")
	h.url.Store(&url)
}

// Start, Success and Fail are the three pings of a cycle.
func (h *HealthCheck) Start()   { h.ping("/start", "") }
func (h *HealthCheck) Success() { h.ping("", "") }
func (h *HealthCheck) Fail(reason string) {
	if len(reason) > 1000 {
		reason = reason[:1000]
	}
	h.ping("/fail", reason)
}

// ping hands a ping over, or drops it when the sender is that far behind.
func (h *HealthCheck) ping(suffix, body string) {
	if h == nil || *h.url.Load() == "" {
		return
	}
	select {
	case h.to.pings <- ping{worker: h.worker, url: *h.url.Load(), suffix: suffix, body: body, at: time.Now()}:
	default:
		h.log.Debug("healthchecks ping dropped: the sender is behind", "ping", strings.TrimPrefix(suffix, "/"))
	}
}

// redactURLError drops the URL that net/http puts in its errors.
func redactURLError(err error) error {
	if ue, ok := err.(interface{ Unwrap() error }); ok && strings.Contains(err.Error(), "://") {
		if inner := ue.Unwrap(); inner != nil {
			return inner
		}
	}
	return err
}
