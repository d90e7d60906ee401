package main

import (
	"context"
	"crypto/rsa"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/google/go-github/v75/github"
)

// GitHubApp is the client of the App's own REST endpoints (go-github),
// authenticated with the App JWT. go-github honours GitHub's rate limits: once
// an answer said the limit is spent (X-RateLimit-Remaining: 0 until
// X-RateLimit-Reset) or asked to slow down (a secondary limit, Retry-After),
// it refuses further calls until then without sending them, and those
// refusals are errors the callers retry later.
type GitHubApp struct {
	appID  int64
	key    *rsa.PrivateKey
	client *github.Client
	log    *slog.Logger

	// redeliveries paces the redeliveries asked, every caller together.
	redeliveries *rateWindow

	mu         sync.Mutex
	token      string
	tokenExp   time.Time
	pauseUntil time.Time // a 429's Retry-After: nothing is sent before it
}

// NewGitHubApp reads the App's PEM key and points a go-github client at
// api_url.
func NewGitHubApp(cfg GitHubConfig, log *slog.Logger) (*GitHubApp, error) {
	pem, err := os.ReadFile(cfg.PrivateKeyFile)
	if err != nil {
		return nil, fmt.Errorf("github.private_key_file: %w", err)
	}
	key, err := jwt.ParseRSAPrivateKeyFromPEM(pem)
	if err != nil {
		return nil, fmt.Errorf("github.private_key_file: not an RSA private key in PEM: %w", err)
	}
	a := &GitHubApp{appID: cfg.AppID, key: key, log: log, redeliveries: newRateWindow(cfg.RedeliverPerMinute, time.Minute)}
	a.client = github.NewClient(&http.Client{Timeout: 30 * time.Second, Transport: appTransport{app: a}})
	if a.client.BaseURL, err = url.Parse(strings.TrimRight(cfg.APIURL, "/") + "/"); err != nil {
		return nil, fmt.Errorf("github.api_url: %w", err)
	}
	a.client.UserAgent = "switchyard/" + version
	return a, nil
}

// appTransport signs every request with the App JWT.
type appTransport struct{ app *GitHubApp }

func (t appTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	t.app.mu.Lock()
	until := t.app.pauseUntil
	t.app.mu.Unlock()
	if time.Now().Before(until) {
		return nil, fmt.Errorf("%w: told to retry after %s, not sending", ErrGitHubRateLimited, until.UTC().Format(time.RFC3339))
	}
	tok, err := t.app.jwt()
	if err != nil {
		return nil, err
	}
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+tok)
	r.Header.Set("X-GitHub-Api-Version", "2022-11-28")
	resp, err := http.DefaultTransport.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	// Every answer is bounded before it is decoded: a body that says it is
	// larger is refused unread, one that turns out larger fails its decode.
	limit := int64(maxAPIResponse)
	if strings.HasSuffix(r.URL.Path, "/app/hook/deliveries") {
		limit = maxDeliveriesPage
	}
	if resp.ContentLength > limit {
		resp.Body.Close()
		return nil, fmt.Errorf("%w: %s says %d bytes, over %d", ErrAPIResponseTooLarge, r.URL.Path, resp.ContentLength, limit)
	}
	resp.Body = &boundedBody{ReadCloser: resp.Body, left: limit}
	return resp, nil
}

// maxAPIResponse bounds any answer of GitHub's API: a delivery with its
// request holds a payload of up to GitHub's 25 MB webhook limit, but one
// over 16 MiB is more than switchyard takes. maxDeliveriesPage bounds a
// page of the deliveries list: 100 deliveries weigh some 70 KB, and the JSON
// decoder holds the whole page before it decodes.
const (
	maxAPIResponse    = 16 << 20
	maxDeliveriesPage = 1 << 20
)

// ErrAPIResponseTooLarge is an answer of GitHub's API over its bound.
var ErrAPIResponseTooLarge = errors.New("GitHub API answer too large")

// boundedBody fails a read past left bytes.
type boundedBody struct {
	io.ReadCloser
	left int64
}

func (b *boundedBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, ErrAPIResponseTooLarge
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}

// jwt returns the App JWT: RS256, issued 60 s in the past against clock
// drift, expiring in 9 minutes (GitHub refuses more than 10). It is reused
// until a minute before it expires.
func (a *GitHubApp) jwt() (string, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	if a.token != "" && now.Before(a.tokenExp.Add(-time.Minute)) {
		return a.token, nil
	}
	exp := now.Add(9 * time.Minute)
	tok, err := jwt.NewWithClaims(jwt.SigningMethodRS256, jwt.RegisteredClaims{
		IssuedAt:  jwt.NewNumericDate(now.Add(-60 * time.Second)),
		ExpiresAt: jwt.NewNumericDate(exp),
		Issuer:    strconv.FormatInt(a.appID, 10),
	}).SignedString(a.key)
	if err != nil {
		return "", fmt.Errorf("sign app jwt: %w", err)
	}
	a.token, a.tokenExp = tok, exp
	return tok, nil
}

// githubStatusError is an unsuccessful answer of GitHub's API.
type githubStatusError struct {
	Status int
	Msg    string
}

func (e *githubStatusError) Error() string {
	return fmt.Sprintf("GitHub API answered %d: %s", e.Status, e.Msg)
}

// ErrGitHubUnauthorized is a 401: the App id or key is wrong.
var ErrGitHubUnauthorized = errors.New("GitHub rejected the App JWT (401): check github.app_id and github.private_key_file")

// ErrGitHubRateLimited is GitHub's rate limit, primary or secondary: nothing
// is sent to GitHub until the time the error names.
var ErrGitHubRateLimited = errors.New("GitHub API rate limit")

// apiError says what a go-github error means here: a 401 is
// ErrGitHubUnauthorized, logged as the configuration error it is; a rate
// limit is ErrGitHubRateLimited with the time it ends; any other answer a
// githubStatusError (a 404 the caller may take as permanent); all of them,
// but a 404, are transient for the callers.
func (a *GitHubApp) apiError(err error) error {
	var rl *github.RateLimitError
	var abuse *github.AbuseRateLimitError
	var er *github.ErrorResponse
	switch {
	case errors.As(err, &rl):
		return fmt.Errorf("%w: spent until %s", ErrGitHubRateLimited, rl.Rate.Reset.Time.UTC().Format(time.RFC3339))
	case errors.As(err, &abuse):
		wait := "a while"
		if abuse.RetryAfter != nil {
			wait = abuse.RetryAfter.String()
		}
		return fmt.Errorf("%w: secondary limit, retry after %s", ErrGitHubRateLimited, wait)
	case errors.As(err, &er) && er.Response != nil && er.Response.StatusCode == http.StatusTooManyRequests:
		// go-github leaves 429 to its callers: honour its Retry-After here.
		wait := time.Minute
		if secs, err := strconv.Atoi(er.Response.Header.Get("Retry-After")); err == nil && secs >= 0 {
			wait = time.Duration(secs) * time.Second
		}
		a.mu.Lock()
		a.pauseUntil = time.Now().Add(wait)
		a.mu.Unlock()
		return fmt.Errorf("%w: 429, retry after %s", ErrGitHubRateLimited, wait)
	case errors.As(err, &er) && er.Response != nil && er.Response.StatusCode == http.StatusUnauthorized:
		a.log.Error("GitHub API configuration error", "error", ErrGitHubUnauthorized, "url", er.Response.Request.URL.Path)
		return ErrGitHubUnauthorized
	case errors.As(err, &er) && er.Response != nil:
		return &githubStatusError{Status: er.Response.StatusCode, Msg: er.Message}
	}
	return fmt.Errorf("GitHub API: %w", err)
}

// hookDelivery is one attempt in GET /app/hook/deliveries.
type hookDelivery struct {
	ID          int64     `json:"id"`
	GUID        string    `json:"guid"`
	DeliveredAt time.Time `json:"delivered_at"`
	Redelivery  bool      `json:"redelivery"`
	Status      string    `json:"status"`
	StatusCode  int       `json:"status_code"`
	Event       string    `json:"event"`
	Action      *string   `json:"action"`
}

// hookDeliveryDetail is GET /app/hook/deliveries/{id}: the attempt with the
// original request.
type hookDeliveryDetail struct {
	hookDelivery
	Request struct {
		Headers map[string]string
		Payload json.RawMessage
	}
}

// fromGitHub reads go-github's delivery into switchyard's.
func fromGitHub(d *github.HookDelivery) hookDelivery {
	return hookDelivery{ID: d.GetID(), GUID: d.GetGUID(), DeliveredAt: d.GetDeliveredAt().Time, Redelivery: d.GetRedelivery(),
		Status: d.GetStatus(), StatusCode: d.GetStatusCode(), Event: d.GetEvent(), Action: d.Action}
}

// deliveriesPage is the page size asked of GET /app/hook/deliveries, the
// most GitHub gives.
const deliveriesPage = 100

// EachDeliveryPage pages through the App's deliveries, newest first, back to
// since, and hands fn each page's attempts delivered at or after it, one
// page at a time. It reads at most maxPages pages and stops at a cursor it
// has seen before (an API that loops), and at a page longer than asked.
// complete reports whether it got back to since; when it did not, the
// caller's checkpoint must not move past what it did not see.
func (a *GitHubApp) EachDeliveryPage(ctx context.Context, since time.Time, maxPages int, fn func([]hookDelivery) error) (complete bool, err error) {
	opts := &github.ListCursorOptions{PerPage: deliveriesPage}
	seen := map[string]bool{}
	for pages := 0; ; pages++ {
		if pages == maxPages {
			a.log.Warn("GitHub's deliveries: stopped after github.max_pages_per_poll pages; the next poll goes on from the checkpoint",
				"pages", pages, "since", formatTime(since))
			return false, nil
		}
		page, resp, err := a.client.Apps.ListHookDeliveries(ctx, opts)
		if err != nil {
			return false, a.apiError(err)
		}
		if len(page) > deliveriesPage {
			return false, fmt.Errorf("GitHub's deliveries: a page of %d, asked for %d", len(page), deliveriesPage)
		}
		older := false
		batch := make([]hookDelivery, 0, len(page))
		for _, d := range page {
			hd := fromGitHub(d)
			if hd.DeliveredAt.Before(since) {
				older = true // older than the checkpoint: this page is the last one needed
				continue
			}
			batch = append(batch, hd)
		}
		if err := fn(batch); err != nil {
			return false, err
		}
		if older || resp.Cursor == "" {
			return true, nil
		}
		if seen[resp.Cursor] {
			a.log.Warn("GitHub's deliveries: a cursor came back again; the poll stops there", "pages", pages+1)
			return false, nil
		}
		seen[resp.Cursor] = true
		opts.Cursor = resp.Cursor
	}
}

// Delivery fetches one attempt with its original headers and payload.
func (a *GitHubApp) Delivery(ctx context.Context, id int64) (*hookDeliveryDetail, error) {
	d, _, err := a.client.Apps.GetHookDelivery(ctx, id)
	if err != nil {
		return nil, a.apiError(err)
	}
	out := &hookDeliveryDetail{hookDelivery: fromGitHub(d)}
	if r := d.Request; r != nil {
		out.Request.Headers = r.Headers
		if r.RawPayload != nil {
			out.Request.Payload = *r.RawPayload
		}
	}
	return out, nil
}

// RedeliverPerMinute is github.redeliver_per_minute: the most
// redeliveries Redeliver asks in any minute.
func (a *GitHubApp) RedeliverPerMinute() int { return a.redeliveries.n }

// ID is the App's id (github.app_id): its hook's copy of an event is the
// one its deliveries speak of.
func (a *GitHubApp) ID() int64 { return a.appID }

// ErrRedeliveryPaced is a redelivery not asked because
// github.redeliver_per_minute were asked in the last minute.
var ErrRedeliveryPaced = errors.New("github.redeliver_per_minute reached; asked later")

// Redeliver asks GitHub to deliver an attempt again (POST
// /app/hook/deliveries/{id}/attempts): the webhook comes back through the
// endpoint like any other, with redelivery set. At most
// github.redeliver_per_minute are asked in any minute; past that it returns
// ErrRedeliveryPaced without asking.
func (a *GitHubApp) Redeliver(ctx context.Context, id int64) error {
	if !a.redeliveries.take(time.Now()) {
		return ErrRedeliveryPaced
	}
	if _, _, err := a.client.Apps.RedeliverHookDelivery(ctx, id); err != nil {
		var accepted *github.AcceptedError // 202: queued by GitHub, which is what was asked
		if errors.As(err, &accepted) {
			return nil
		}
		return a.apiError(err)
	}
	return nil
}

// rateWindow lets at most n events through in any span of per.
type rateWindow struct {
	n   int
	per time.Duration

	mu    sync.Mutex
	times []time.Time // the events of the last span, oldest first
}

func newRateWindow(n int, per time.Duration) *rateWindow {
	return &rateWindow{n: max(n, 1), per: per}
}

// take reports whether one more event may happen at now, and counts it if so.
func (w *rateWindow) take(now time.Time) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for len(w.times) > 0 && now.Sub(w.times[0]) >= w.per {
		w.times = w.times[1:]
	}
	if len(w.times) >= w.n {
		return false
	}
	w.times = append(w.times, now)
	return true
}
