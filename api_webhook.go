package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

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

// Webhook is the POST /webhooks/github endpoint: bound, verify, then
// commit to the outbox.
type Webhook struct {
	// auth is what a SIGHUP may change: secrets, allow list, proxies.
	auth    atomic.Pointer[webhookAuth]
	brokers *Brokers
	// outbox takes every webhook: committed first, forwarded after.
	outbox   *Outbox
	log      *slog.Logger
	metrics  *Metrics
	inflight *inflightBodies
	rejects  *logLimiter
	// refused keeps each refusal in rejected_webhooks; nil keeps none.
	refused *RejectLog

	// bodies holds request body buffers between webhooks: a 25 KB payload
	// would otherwise be allocated and zeroed for each one, and collected.
	bodies sync.Pool
}

// webhookAuth is who may deliver: the accepted secrets, the hooks that
// keep their own, the sources allowed into github-exchange and the
// proxies believed for the source.
type webhookAuth struct {
	secrets [][]byte
	hooks   map[int64][][]byte
	allowed prefixSet
	proxies prefixSet
}

// secretsOf are the secrets a webhook from the hook named by the
// X-GitHub-Hook-ID value id is verified with: a listed hook's own only,
// else github.webhook_secret and its previous ones (a malformed ID, too:
// its webhook is refused for the header once signed); and the listed hook
// whose secrets they are (-1 for github.webhook_secret's).
func (a *webhookAuth) secretsOf(id string) ([][]byte, int64) {
	if len(a.hooks) > 0 {
		if hook, err := parseHookID(id); err == nil {
			if s, ok := a.hooks[hook]; ok {
				return s, hook
			}
		}
	}
	return a.secrets, -1
}

// badSignature is the 401 of a signature that none of the secrets made:
// it names the secret GitHub's hook should have, so that the operator
// reading Recent Deliveries knows which to set.
func badSignature(hook int64) error {
	if hook >= 0 {
		return errorf(CodeUnauthorized, "%s: the secret of hook %d in GitHub is not its secret in [[github.hooks]]", ErrBadSignature.Message, hook)
	}
	return errorf(CodeUnauthorized, "%s: the hook's secret in GitHub is not github.webhook_secret", ErrBadSignature.Message)
}

// newWebhookAuth reads the config's secrets and networks; the allow list is
// meta_file's hooks, else allowed_cidrs, else GitHub's ranges built in.
func newWebhookAuth(cfg *Config) (*webhookAuth, error) {
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
	auth := &webhookAuth{allowed: allowed, proxies: proxies}
	auth.secrets = secretBytes(cfg.GitHub.WebhookSecret, cfg.GitHub.PreviousWebhookSecrets)
	if len(cfg.GitHub.Hooks) > 0 {
		auth.hooks = map[int64][][]byte{}
		for _, h := range cfg.GitHub.Hooks {
			if h.Secret != "" { // else a ledger's hook that signs with webhook_secret
				auth.hooks[h.ID] = secretBytes(h.Secret, h.PreviousSecrets)
			}
		}
	}
	return auth, nil
}

// secretBytes are a secret and its previous ones, as the HMAC takes them.
func secretBytes(current string, previous []string) [][]byte {
	out := [][]byte{[]byte(current)}
	for _, s := range previous {
		out = append(out, []byte(s))
	}
	return out
}

// NewWebhook builds the endpoint from the config; refused, when set, keeps
// the webhooks it refuses.
func NewWebhook(cfg *Config, brokers *Brokers, outbox *Outbox, metrics *Metrics, refused *RejectLog, log *slog.Logger) (*Webhook, error) {
	auth, err := newWebhookAuth(cfg)
	if err != nil {
		return nil, err
	}
	wh := &Webhook{brokers: brokers, outbox: outbox, metrics: metrics, refused: refused, log: log,
		inflight: newInflightBodies(cfg.Server.MaxInflightBytes), rejects: newLogLimiter(10 * time.Second)}
	wh.auth.Store(auth)
	wh.bodies.New = func() any { return new([]byte) }
	return wh, nil
}

// Reload takes new secrets, allow list and proxies from cfg (SIGHUP).
func (wh *Webhook) Reload(cfg *Config) error {
	auth, err := newWebhookAuth(cfg)
	if err != nil {
		return err
	}
	wh.auth.Store(auth)
	return nil
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
	proxies := wh.auth.Load().proxies
	if !proxies.contains(peer) {
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
		if !proxies.contains(addr) {
			break
		}
	}
	return addr
}

// maxPooledBody is the largest buffer kept for reuse; a rare multi-megabyte
// payload is left to the collector instead of being held forever.
const maxPooledBody = 1 << 20

// firstReserve is the most reserved for a body before any of it arrived:
// Content-Length is a claim, not bytes, and it is believed only as far as
// this; beyond it the buffer grows as bytes come.
const firstReserve = 64 << 10

// inflightBodies bounds the webhook body bytes held at once
// (server.max_inflight_bytes): every
// body takes its size from it before it is read, and gives it back when the
// request ends. Bytes beyond a body's first firstReserve may hold at most
// three quarters of it together: the last quarter is kept for ordinary
// webhooks (GitHub's are tens of KB), so that a flood of large or slow
// bodies, signed or not, cannot starve them.
type inflightBodies struct {
	mu           sync.Mutex
	limit        int64
	used, large  int64 // all bytes taken; the part of them beyond firstReserve
	maxLargePart int64
}

func newInflightBodies(limit int64) *inflightBodies {
	return &inflightBodies{limit: limit, maxLargePart: limit * 3 / 4}
}

// reserve reserves n more bytes for a body that already holds had; false, and
// nothing taken, when they do not fit.
func (b *inflightBodies) reserve(had, n int64) bool {
	large := max(0, had+n-firstReserve) - max(0, had-firstReserve)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.used+n > b.limit || b.large+large > b.maxLargePart {
		return false
	}
	b.used += n
	b.large += large
	return true
}

// free returns a body's whole reservation of n bytes.
func (b *inflightBodies) free(n int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.used -= n
	b.large -= max(0, n-firstReserve)
}

// readBody reads the request body within server.max_inflight_bytes
// (inflightBodies) and returns it in *buf's memory. A Content-Length over
// 25 MiB is refused before reading; so is one that does not fit (ErrBusy).
// A body of unknown length is charged step by step as it arrives. Either way the buffer grows only as
// bytes come, and never past what was charged. release gives the charge back;
// call it once the body is no longer used.
func (wh *Webhook) readBody(w http.ResponseWriter, r *http.Request, buf *[]byte) (body []byte, release func(), err error) {
	var charged int64
	release = func() { wh.inflight.free(charged) }
	if r.ContentLength > maxWebhookBody {
		return nil, release, errorf(CodeTooLarge, "%s: Content-Length over %d bytes", ErrTooLarge.Message, maxWebhookBody)
	}
	if n := r.ContentLength; n >= 0 {
		// One byte more than claimed, to read the end of the body.
		if !wh.inflight.reserve(0, n+1) {
			return nil, release, ErrBusy
		}
		charged = n + 1
	}
	src := http.MaxBytesReader(w, r.Body, maxWebhookBody)
	b := (*buf)[:0]
	defer func() { *buf = b }()
	for {
		if int64(len(b)) == charged {
			step := min(max(firstReserve, charged), maxWebhookBody+1-charged)
			if !wh.inflight.reserve(charged, step) {
				return nil, release, ErrBusy
			}
			charged += step
		}
		if len(b) == cap(b) {
			b = slices.Grow(b, int(min(max(firstReserve, int64(cap(b))), charged-int64(len(b)))))
		}
		k, err := src.Read(b[len(b):min(int64(cap(b)), charged)])
		b = b[:len(b)+k]
		var mbe *http.MaxBytesError
		switch {
		case err == io.EOF:
			return b, release, nil
		case errors.As(err, &mbe):
			return nil, release, errorf(CodeTooLarge, "%s: over %d bytes", ErrTooLarge.Message, maxWebhookBody)
		case err != nil:
			return nil, release, &Error{Code: CodeInvalid, Message: "the body could not be read", Err: err}
		}
	}
}

// readPayload reads the body into buf, checks the signature over it, and
// returns the JSON payload (the body itself, or its payload= field when
// form-encoded), which may share buf's memory.
func (wh *Webhook) readPayload(w http.ResponseWriter, r *http.Request, buf *[]byte) (payload []byte, release func(), err error) {
	body, release, err := wh.readBody(w, r, buf)
	if err != nil {
		return nil, release, err
	}
	sig := r.Header.Get("X-Hub-Signature-256")
	if sig == "" {
		return nil, release, ErrNoSignature
	}
	if secrets, hook := wh.auth.Load().secretsOf(r.Header.Get("X-GitHub-Hook-ID")); !validSignature(secrets, body, sig) {
		return nil, release, badSignature(hook)
	}
	if err := checkHeaders(r.Header); err != nil {
		return nil, release, err
	}
	payload = body
	if isForm(r.Header.Get("Content-Type")) {
		form, err := url.ParseQuery(string(body))
		if err != nil || !form.Has("payload") {
			return nil, release, errorf(CodeInvalid, "form body without payload=")
		}
		payload = []byte(form.Get("payload"))
	}
	if t := bytes.TrimSpace(payload); len(t) == 0 || t[0] != '{' || !validJSON(t) {
		return nil, release, errorf(CodeInvalid, "payload is not a JSON object")
	}
	return payload, release, nil
}

// isForm tells a form-encoded body (payload=...) from the usual JSON one.
func isForm(contentType string) bool {
	if contentType == "application/json" {
		return false // GitHub's default, without parsing
	}
	mt, _, _ := mime.ParseMediaType(contentType)
	return mt == "application/x-www-form-urlencoded"
}

// queued is the 202 answer: status "queued" (committed to the outbox,
// which forwards it to the broker) or "published" (the store did not take
// it; the broker confirmed it). Queue is set for a webhook from outside the
// allowed sources, which waits in github-forbidden for the cleanup worker:
// whoever sent it by hand learns why no row appears at once.
type queued struct {
	Status     string `json:"status"`
	DeliveryID string `json:"delivery_id"`
	Queue      string `json:"queue,omitempty"`
}

// notQueued is a webhook neither the store nor the broker took. Its public
// text, the 503's body, says what failed in a few fixed texts (the store's,
// and the broker's kind, brokerProblem) with the delivery's GUID; its
// Error, for the log, has the whole cause.
type notQueued struct {
	delivery string
	// store and broker are why each did not take it.
	store, broker error
}

func (e *notQueued) Error() string {
	return fmt.Sprintf("%s: delivery %s %s: %v", e.what(), e.delivery, e.outcome(), errors.Join(e.store, e.broker))
}

// outcome is what became of the message: "not confirmed" when it was
// sent to the broker and its confirm did not come (it may still reach the
// queues, and GitHub's redelivery of it is then a duplicate, stored once),
// else "not queued".
func (e *notQueued) outcome() string {
	if errors.Is(e.broker, ErrUnconfirmed) {
		return "not confirmed"
	}
	return "not queued"
}

// what is the kind of failure in the words of a public answer: the
// store's, then the broker's.
func (e *notQueued) what() string {
	store := "the store did not take it"
	if errors.Is(e.store, ErrOutboxFull) {
		store = "the outbox is full"
	}
	broker := "no confirm from the broker within queue.publish_timeout"
	if p := brokerProblem(e.broker); p != "no confirm" {
		broker = "broker " + p
	}
	return store + ", and " + broker
}

// public is the 503's body text.
func (e *notQueued) public() string {
	return fmt.Sprintf("%s: delivery %s %s, retry later", e.what(), e.delivery, e.outcome())
}

func (e *notQueued) Unwrap() error { return ErrUnavailable }

// rejectOutcome names a refused webhook for the metrics and the log.
func rejectOutcome(err error) string {
	switch statusOf(err) {
	case http.StatusUnauthorized:
		return "unauthorized"
	case http.StatusRequestEntityTooLarge:
		return "too_large"
	case http.StatusServiceUnavailable:
		return "unavailable"
	}
	return "bad_request"
}

// reject answers a refused webhook, records it (RejectLog: what its
// headers claim, never its body or signature), and logs it at warn with
// the reason and source, at most one line per outcome per 10 s: a flood
// of bad requests must not flood the journal too. It returns the outcome
// the request is counted by.
func (wh *Webhook) reject(w http.ResponseWriter, r *http.Request, err error, src netip.Addr) (outcome string) {
	outcome = rejectOutcome(err)
	guid, hook := claimedIdentity(r.Header)
	event := r.Header.Get("X-GitHub-Event")
	if !eventName(event) {
		event = ""
	}
	wh.refused.Note(Rejection{At: time.Now(), SourceIP: addrText(src), Event: event, GUID: guid, Hook: HookID(hook),
		Status: statusOf(err), Reason: err.Error()})
	if ok, suppressed := wh.rejects.allow(outcome, time.Now()); ok {
		args := []any{"outcome", outcome, "status", statusOf(err), "source_ip", addrText(src)}
		if guid != "" || hook >= 0 {
			args = append(args, "delivery_id", guid)
			if hook >= 0 {
				args = append(args, "hook_id", hook)
			}
		}
		args = append(args, "error", err)
		if suppressed > 0 {
			args = append(args, "suppressed", suppressed)
		}
		wh.log.Warn("webhook rejected", args...)
	}
	if statusOf(err) == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", "30")
	}
	writeError(w, r, nil, err) // logged above
	return outcome
}

func addrText(a netip.Addr) string {
	if !a.IsValid() {
		return ""
	}
	return a.String()
}

// ServeHTTP answers 202 only once the webhook is durable: committed to
// the outbox, or, when the store does not take it, confirmed by the broker.
// Each request is counted by its outcome, with the time to its answer.
func (wh *Webhook) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	var outcome string
	defer func() {
		if outcome != "" { // "": the request panicked, and net/http answers it
			wh.metrics.webhook(outcome, traceID(r.Context()), time.Since(start))
		}
	}()
	buf := wh.bodies.Get().(*[]byte)
	src := wh.sourceIP(r)
	payload, release, err := wh.readPayload(w, r, buf)
	// The body's buffer and its share of server.max_inflight_bytes go
	// back once nothing refers to the body: when the webhook has been
	// compressed for the broker (Outbox.Take), so that webhooks waiting
	// for the writer hold their compressed bytes only; else when the
	// request ends, by which time Take is done with it.
	var once sync.Once
	bodyDone := func() {
		once.Do(func() {
			release()
			if cap(*buf) <= maxPooledBody {
				*buf = (*buf)[:0]
				wh.bodies.Put(buf)
			}
		})
	}
	defer bodyDone()
	if err != nil {
		outcome = wh.reject(w, r, err, src)
		return
	}
	exchange, key := exchangeName, ""
	if !src.IsValid() || !wh.auth.Load().allowed.contains(src) {
		exchange, key = "", queueForbidden
	}
	msg := newPublishing(r.Header, payload, addrText(src), time.Now())
	traceWebhook(r.Context(), &msg, r.Header.Get(hdrHookID))

	took := wh.outbox.Take(r.Context(), exchange, key, msg, bodyDone)
	var tooLarge *TooLargeError
	switch {
	case took.Outcome == Refused && errors.As(took.Err, &tooLarge):
		outcome = wh.reject(w, r, errorf(CodeTooLarge, "%s: delivery %s not queued: %v", ErrTooLarge.Message, msg.MessageId, tooLarge), src)
		return
	case took.Outcome == Refused:
		outcome = wh.reject(w, r, &notQueued{delivery: msg.MessageId, store: took.StoreErr, broker: took.Err}, src)
		return
	}
	outcome = "accepted"
	status := "queued"
	if took.Outcome == Published {
		outcome, status = "published", "published"
	}
	if key != "" {
		outcome = "forbidden"
	}
	if wh.log.Enabled(r.Context(), slog.LevelDebug) {
		wh.log.With(traceFields(r.Context())...).Debug("webhook "+status, "delivery_id", msg.MessageId, "event", msg.Type,
			"source_ip", addrText(src), "broker", took.Broker.String(), "forbidden", key != "")
	}
	writeJSON(w, http.StatusAccepted, queued{Status: status, DeliveryID: msg.MessageId, Queue: key})
}

// logLimiter lets one log line per key through per period, and counts the
// ones it held back.
type logLimiter struct {
	every time.Duration
	mu    sync.Mutex
	last  map[string]time.Time
	held  map[string]int
}

func newLogLimiter(every time.Duration) *logLimiter {
	return &logLimiter{every: every, last: map[string]time.Time{}, held: map[string]int{}}
}

// allow reports whether a line for key may be logged at now, and how many
// were held back since the last one.
func (l *logLimiter) allow(key string, now time.Time) (ok bool, suppressed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if last, seen := l.last[key]; seen && now.Sub(last) < l.every {
		l.held[key]++
		return false, 0
	}
	suppressed = l.held[key]
	l.last[key], l.held[key] = now, 0
	return true, suppressed
}
