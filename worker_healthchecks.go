package main

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

// HealthCheck pings one worker's HealthChecks URL: /start when a cycle
// begins, the URL itself when it succeeds, /fail with a short reason when it
// fails. A ping that fails is logged and changes nothing else. A nil
// *HealthCheck pings nothing.
type HealthCheck struct {
	url    atomic.Pointer[string] // "" pings nothing; a SIGHUP may change it
	worker string
	// lease, when set, is the healthchecks job's: of the nodes sharing a
	// database, only its holder pings, so that one node's cycles tell.
	lease   *Lease
	http    *http.Client
	log     *slog.Logger
	metrics *Metrics
}

// NewHealthCheck pings url for worker, while lease is held (nil: always);
// an empty url pings nothing.
func NewHealthCheck(url, worker string, lease *Lease, metrics *Metrics, log *slog.Logger) *HealthCheck {
	h := &HealthCheck{worker: worker, lease: lease, http: &http.Client{Timeout: 10 * time.Second},
		log: log.With("worker", worker), metrics: metrics}
	h.SetURL(url)
	return h
}

// SetURL changes the ping URL (SIGHUP); "" stops the pings.
func (h *HealthCheck) SetURL(url string) {
	url = strings.TrimRight(url, "/")
	h.url.Store(&url)
}

// Start, Success and Fail are the three pings of a cycle.
func (h *HealthCheck) Start(ctx context.Context)   { h.ping(ctx, "/start", "") }
func (h *HealthCheck) Success(ctx context.Context) { h.ping(ctx, "", "") }
func (h *HealthCheck) Fail(ctx context.Context, reason string) {
	if len(reason) > 1000 {
		reason = reason[:1000]
	}
	h.ping(ctx, "/fail", reason)
}

func (h *HealthCheck) ping(ctx context.Context, suffix, body string) {
	if h == nil || ctx.Err() != nil || *h.url.Load() == "" || !h.lease.Held() {
		return
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, *h.url.Load()+suffix, strings.NewReader(body))
	if err != nil {
		h.log.Warn("healthchecks ping not sent", "error", err)
		return
	}
	req.Header.Set("Content-Type", "text/plain; charset=utf-8")
	resp, err := h.http.Do(req)
	if err != nil {
		// The URL is a secret of sorts: log the host only.
		h.metrics.healthCheckFailed(h.worker)
		h.log.Warn("healthchecks ping failed", "host", req.URL.Host, "ping", strings.TrimPrefix(suffix, "/"), "error", redactURLError(err))
		return
	}
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		h.metrics.healthCheckFailed(h.worker)
		h.log.Warn("healthchecks ping refused", "host", req.URL.Host, "ping", strings.TrimPrefix(suffix, "/"), "status", resp.StatusCode)
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
