package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"
)

// maxWebhookBody is GitHub's own cap on a webhook payload.
const maxWebhookBody = 25 << 20

// githubHooksCIDRs are the "hooks" ranges of GitHub's /meta endpoint, used when
// neither allowed_cidrs nor meta_file is configured.
var githubHooksCIDRs = []string{
	"192.30.252.0/22",
	"185.199.108.0/22",
	"140.82.112.0/20",
	"143.55.64.0/20",
	"2a0a:a440::/29",
	"2606:50c0::/32",
}

// Request errors of the webhook endpoint; api.go maps them to statuses.
var (
	ErrBadSignature = errors.New("missing or invalid X-Hub-Signature-256")
	ErrBadRequest   = errors.New("bad request")
	ErrTooLarge     = errors.New("body too large")
)

// loadMetaHooks reads the "hooks" list of a saved GitHub /meta answer.
func loadMetaHooks(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var meta struct {
		Hooks []string `json:"hooks"`
	}
	if err := json.Unmarshal(b, &meta); err != nil {
		return nil, fmt.Errorf("not GitHub /meta JSON: %w", err)
	}
	if len(meta.Hooks) == 0 {
		return nil, errors.New(`no "hooks" ranges in it`)
	}
	for _, c := range meta.Hooks {
		if _, err := parsePrefix(c); err != nil {
			return nil, fmt.Errorf("hooks: %w", err)
		}
	}
	return meta.Hooks, nil
}

// prefixSet is a list of networks an address can be tested against.
type prefixSet []netip.Prefix

func newPrefixSet(cidrs []string) (prefixSet, error) {
	var s prefixSet
	for _, c := range cidrs {
		p, err := parsePrefix(c)
		if err != nil {
			return nil, err
		}
		s = append(s, p)
	}
	return s, nil
}

func (s prefixSet) contains(a netip.Addr) bool {
	a = a.Unmap()
	for _, p := range s {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// Webhook is the POST /webhooks/github endpoint: verify, then publish.
type Webhook struct {
	secrets [][]byte
	allowed prefixSet
	proxies prefixSet
	timeout time.Duration
	brokers *Brokers
	queues  *Queues
	log     *slog.Logger
	metrics *Metrics

	// bodies holds request body buffers between webhooks: a 25 KB payload
	// would otherwise be allocated and zeroed for each one, and collected.
	bodies sync.Pool
}

// NewWebhook builds the endpoint from the config; the allow list is meta_file's
// hooks, else allowed_cidrs, else GitHub's ranges built in.
func NewWebhook(cfg *Config, brokers *Brokers, queues *Queues, log *slog.Logger) (*Webhook, error) {
	cidrs := githubHooksCIDRs
	if len(cfg.GitHub.AllowedCIDRs) > 0 {
		cidrs = cfg.GitHub.AllowedCIDRs
	}
	if cfg.GitHub.MetaFile != "" {
		hooks, err := loadMetaHooks(cfg.GitHub.MetaFile)
		if err != nil {
			return nil, fmt.Errorf("github.meta_file: %w", err)
		}
		cidrs = hooks
	}
	allowed, err := newPrefixSet(cidrs)
	if err != nil {
		return nil, err
	}
	proxies, err := newPrefixSet(cfg.Server.TrustedProxies)
	if err != nil {
		return nil, err
	}
	wh := &Webhook{allowed: allowed, proxies: proxies, timeout: cfg.Queue.PublishTimeout,
		brokers: brokers, queues: queues, log: log}
	wh.bodies.New = func() any { return new(bytes.Buffer) }
	for _, s := range append([]string{cfg.GitHub.WebhookSecret}, cfg.GitHub.PreviousWebhookSecrets...) {
		wh.secrets = append(wh.secrets, []byte(s))
	}
	return wh, nil
}

// verifySignature checks X-Hub-Signature-256 against every accepted secret,
// in constant time per secret.
func (wh *Webhook) verifySignature(body []byte, header string) bool {
	sig, ok := strings.CutPrefix(header, "sha256=")
	if !ok {
		return false
	}
	want, err := hex.DecodeString(sig)
	if err != nil || len(want) != sha256.Size {
		return false
	}
	valid := false
	for _, secret := range wh.secrets {
		mac := hmac.New(sha256.New, secret)
		mac.Write(body)
		if hmac.Equal(mac.Sum(nil), want) {
			valid = true
		}
	}
	return valid
}

// sourceIP is the peer address, or, when the peer is a trusted proxy, the
// right-most X-Forwarded-For address that is not one.
func (wh *Webhook) sourceIP(r *http.Request) netip.Addr {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	peer, err := netip.ParseAddr(host)
	if err != nil {
		return netip.Addr{}
	}
	peer = peer.Unmap()
	if !wh.proxies.contains(peer) {
		return peer
	}
	var hops []string
	for _, v := range r.Header.Values("X-Forwarded-For") {
		hops = append(hops, strings.Split(v, ",")...)
	}
	addr := peer
	for i := len(hops) - 1; i >= 0; i-- {
		a, err := netip.ParseAddr(strings.TrimSpace(hops[i]))
		if err != nil {
			break // a garbled hop: trust nothing left of it
		}
		addr = a.Unmap()
		if !wh.proxies.contains(addr) {
			break
		}
	}
	return addr
}

// maxPooledBody is the largest buffer kept for reuse; a rare multi-megabyte
// payload is left to the collector instead of being held forever.
const maxPooledBody = 1 << 20

// readPayload reads the body into buf, checks the signature over it, and
// returns the JSON payload (the body itself, or its payload= field when
// form-encoded), which may share buf's memory.
func (wh *Webhook) readPayload(w http.ResponseWriter, r *http.Request, buf *bytes.Buffer) ([]byte, error) {
	// Size the buffer from Content-Length (bounded) instead of growing it
	// by doubling: a 25 KB payload would otherwise be copied six times.
	if n := r.ContentLength; n > 0 && n <= maxWebhookBody {
		buf.Grow(int(n) + 1)
	}
	_, err := buf.ReadFrom(http.MaxBytesReader(w, r.Body, maxWebhookBody))
	body := buf.Bytes()
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return nil, fmt.Errorf("%w: over %d bytes", ErrTooLarge, maxWebhookBody)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: read body: %v", ErrBadRequest, err)
	}
	if !wh.verifySignature(body, r.Header.Get("X-Hub-Signature-256")) {
		return nil, ErrBadSignature
	}
	if r.Header.Get("X-GitHub-Event") == "" || r.Header.Get("X-GitHub-Delivery") == "" {
		return nil, fmt.Errorf("%w: X-GitHub-Event and X-GitHub-Delivery are required", ErrBadRequest)
	}
	payload := body
	if isForm(r.Header.Get("Content-Type")) {
		form, err := url.ParseQuery(string(body))
		if err != nil || !form.Has("payload") {
			return nil, fmt.Errorf("%w: form body without payload=", ErrBadRequest)
		}
		payload = []byte(form.Get("payload"))
	}
	if t := bytes.TrimSpace(payload); len(t) == 0 || t[0] != '{' || !validJSON(t) {
		return nil, fmt.Errorf("%w: payload is not a JSON object", ErrBadRequest)
	}
	return payload, nil
}

// isForm tells a form-encoded body (payload=...) from the usual JSON one.
func isForm(contentType string) bool {
	if contentType == "application/json" {
		return false // GitHub's default, without parsing
	}
	mt, _, _ := mime.ParseMediaType(contentType)
	return mt == "application/x-www-form-urlencoded"
}

// queued is the 202 answer.
type queued struct {
	Status     string `json:"status"`
	DeliveryID string `json:"delivery_id"`
}

// rejectOutcome names a refused webhook for the metrics.
func rejectOutcome(err error) string {
	switch statusOf(err) {
	case http.StatusUnauthorized:
		return "unauthorized"
	case http.StatusRequestEntityTooLarge:
		return "too_large"
	}
	return "bad_request"
}

// ServeHTTP answers 202 only once the broker confirmed the message.
func (wh *Webhook) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	buf := wh.bodies.Get().(*bytes.Buffer)
	defer func() {
		// Publish has written the body to the connection by the time it
		// returns, whatever the outcome: nothing holds buf after this.
		if buf.Cap() <= maxPooledBody {
			buf.Reset()
			wh.bodies.Put(buf)
		}
	}()
	payload, err := wh.readPayload(w, r, buf)
	if err != nil {
		wh.metrics.webhook(rejectOutcome(err))
		writeError(w, r, wh.log, err)
		return
	}
	src := wh.sourceIP(r)
	exchange, key := exchangeName, ""
	if !src.IsValid() || !wh.allowed.contains(src) {
		exchange, key = "", queueForbidden
	}
	srcText := ""
	if src.IsValid() {
		srcText = src.String()
	}
	msg := newPublishing(r.Header, payload, srcText, time.Now())

	st := wh.brokers.Cached()
	b, err := wh.brokers.Get(st.PublishTarget())
	if err == nil {
		ctx, cancel := context.WithTimeout(r.Context(), wh.timeout)
		err = wh.queues.Publish(ctx, b, exchange, key, msg)
		cancel()
	}
	if err != nil {
		wh.metrics.webhook("unavailable")
		wh.log.Warn("webhook not queued", "delivery_id", msg.MessageId, "event", msg.Type, "source_ip", srcText, "error", err)
		w.Header().Set("Retry-After", "30")
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "not queued: broker unavailable, retry later"})
		return
	}
	outcome := "accepted"
	if key != "" {
		outcome = "forbidden"
	}
	wh.metrics.webhook(outcome)
	if wh.log.Enabled(r.Context(), slog.LevelDebug) {
		wh.log.Debug("webhook queued", "delivery_id", msg.MessageId, "event", msg.Type, "source_ip", srcText,
			"broker", b.String(), "forbidden", key != "")
	}
	writeJSON(w, http.StatusAccepted, queued{Status: "queued", DeliveryID: msg.MessageId})
}
