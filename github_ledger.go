package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-github/v75/github"
)

// HookLedger is GitHub's record of one hook's deliveries, each hook's
// through its own endpoints and credential: the App's own hook
// (/app/hook/deliveries, with the App's JWT), a repository's webhook
// (/repos/OWNER/NAME/hooks/ID/deliveries) or an organization's
// (/orgs/ORG/hooks/ID/deliveries), with the hook's token, or else the
// App's installation token there.
type HookLedger struct {
	// hook is the ledger's key in the store (delivery_gaps,
	// hook_redeliveries, github_attempts): the hook's ID, 0 for the App's.
	hook  int64
	repo  string // OWNER/NAME of a repository's webhook
	org   string // ORG of an organization's webhook
	appID int64  // the App's (its hook's ledger only)
	api   *githubAPI
	// redeliveries paces the redeliveries asked with this ledger's
	// credential, shared with every ledger of the same credential.
	redeliveries *rateWindow
}

// ErrHookTokenRefused is a hook's token GitHub refused (401).
var ErrHookTokenRefused = errors.New("GitHub refused the hook's token (401): check its token in [[github.hooks]]")

// AppLedger is the ledger of the App's own hook.
func AppLedger(app *GitHubApp) *HookLedger {
	return &HookLedger{appID: app.appID, api: app.api, redeliveries: app.redeliveries}
}

// NewHookLedgers are the ledgers cfg names: the App's hook's, when the App
// is configured (app not nil), and each [[github.hooks]] entry's with a
// repository or an organization, through its token or the App's
// installation token. Hooks with the same token share one client and one
// pace; those on the App's installation tokens share the App's pace.
func NewHookLedgers(cfg GitHubConfig, app *GitHubApp, log *slog.Logger) ([]*HookLedger, error) {
	var ledgers []*HookLedger
	if app != nil {
		ledgers = append(ledgers, AppLedger(app))
	}
	byToken := map[string]*HookLedger{}
	for _, h := range cfg.Hooks {
		if h.Repository == "" && h.Organization == "" {
			continue
		}
		l := &HookLedger{hook: h.ID, repo: h.Repository, org: h.Organization}
		switch shared, ok := byToken[h.Token]; {
		case h.Token == "":
			if app == nil {
				return nil, fmt.Errorf("github.hooks: hook %d has no token and no App is configured", h.ID)
			}
			repo, org := h.Repository, h.Organization
			api, err := newGitHubAPI(cfg.APIURL, func(ctx context.Context) (string, error) { return app.installationToken(ctx, repo, org) },
				ErrHookTokenRefused, log.With("hook", h.ID))
			if err != nil {
				return nil, err
			}
			l.api, l.redeliveries = api, app.redeliveries
		case ok:
			l.api, l.redeliveries = shared.api, shared.redeliveries
		default:
			token := h.Token
			api, err := newGitHubAPI(cfg.APIURL, func(context.Context) (string, error) { return token, nil }, ErrHookTokenRefused, log.With("hook", h.ID))
			if err != nil {
				return nil, err
			}
			l.api, l.redeliveries = api, newRateWindow(cfg.RedeliverPerMinute, time.Minute)
			byToken[h.Token] = l
		}
		ledgers = append(ledgers, l)
	}
	return ledgers, nil
}

// Hook is the ledger's key: the hook's ID, 0 for the App's own hook.
func (l *HookLedger) Hook() int64 { return l.hook }

// String names the hook for logs and status.
func (l *HookLedger) String() string {
	switch {
	case l.repo != "":
		return fmt.Sprintf("repository %s hook %d", l.repo, l.hook)
	case l.org != "":
		return fmt.Sprintf("organization %s hook %d", l.org, l.hook)
	}
	return fmt.Sprintf("the App's hook (app %d)", l.appID)
}

// hookName names a ledger's hook in a table or a metric's label: its ID,
// "app" for the App's own.
func hookName(hook int64) string {
	if hook == 0 {
		return "app"
	}
	return strconv.FormatInt(hook, 10)
}

// deliveriesPage is the page size asked of a deliveries list, the most
// GitHub gives.
const deliveriesPage = 100

func (l *HookLedger) list(ctx context.Context, opts *github.ListCursorOptions) ([]*github.HookDelivery, *github.Response, error) {
	c := l.api.client
	switch {
	case l.repo != "":
		owner, name, _ := strings.Cut(l.repo, "/")
		return c.Repositories.ListHookDeliveries(ctx, owner, name, l.hook, opts)
	case l.org != "":
		return c.Organizations.ListHookDeliveries(ctx, l.org, l.hook, opts)
	}
	return c.Apps.ListHookDeliveries(ctx, opts)
}

func (l *HookLedger) get(ctx context.Context, id int64) (*github.HookDelivery, error) {
	c := l.api.client
	var d *github.HookDelivery
	var err error
	switch {
	case l.repo != "":
		owner, name, _ := strings.Cut(l.repo, "/")
		d, _, err = c.Repositories.GetHookDelivery(ctx, owner, name, l.hook, id)
	case l.org != "":
		d, _, err = c.Organizations.GetHookDelivery(ctx, l.org, l.hook, id)
	default:
		d, _, err = c.Apps.GetHookDelivery(ctx, id)
	}
	return d, err
}

func (l *HookLedger) redeliver(ctx context.Context, id int64) error {
	c := l.api.client
	var err error
	switch {
	case l.repo != "":
		owner, name, _ := strings.Cut(l.repo, "/")
		_, _, err = c.Repositories.RedeliverHookDelivery(ctx, owner, name, l.hook, id)
	case l.org != "":
		_, _, err = c.Organizations.RedeliverHookDelivery(ctx, l.org, l.hook, id)
	default:
		_, _, err = c.Apps.RedeliverHookDelivery(ctx, id)
	}
	return err
}

// EachDeliveryPage pages through the hook's deliveries, newest first, back
// to since, and hands fn each page's attempts delivered at or after it,
// one page at a time. It reads at most maxPages pages and stops at a
// cursor it has seen before (an API that loops), and at a page longer than
// asked. complete reports whether it got back to since; when it did not,
// the caller's checkpoint must not move past what it did not see.
func (l *HookLedger) EachDeliveryPage(ctx context.Context, since time.Time, maxPages int, fn func([]hookDelivery) error) (complete bool, err error) {
	opts := &github.ListCursorOptions{PerPage: deliveriesPage}
	seen := map[string]bool{}
	for pages := 0; ; pages++ {
		if pages == maxPages {
			l.api.log.Warn("GitHub's deliveries: stopped after github.max_pages_per_poll pages; the next poll goes on from the checkpoint",
				"hook", l.String(), "pages", pages, "since", formatTime(since))
			return false, nil
		}
		page, resp, err := l.list(ctx, opts)
		if err != nil {
			return false, l.api.apiError(err)
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
			l.api.log.Warn("GitHub's deliveries: a cursor came back again; the poll stops there", "hook", l.String(), "pages", pages+1)
			return false, nil
		}
		seen[resp.Cursor] = true
		opts.Cursor = resp.Cursor
	}
}

// Delivery fetches one attempt with its original headers and payload.
func (l *HookLedger) Delivery(ctx context.Context, id int64) (*hookDeliveryDetail, error) {
	d, err := l.get(ctx, id)
	if err != nil {
		return nil, l.api.apiError(err)
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

// copyHeaders marks hdr, a fetched delivery's original headers, as this
// hook's copy, whatever GitHub's record kept of the request: the ledger
// counts it stored from that copy only. The App hook's carries the App's
// installation target (its typed rows are filled from it); another hook's
// its hook ID.
func (l *HookLedger) copyHeaders(hdr http.Header) {
	if l.appID != 0 {
		hdr.Set(hdrTargetType, "integration")
		hdr.Set(hdrTargetID, strconv.FormatInt(l.appID, 10))
		return
	}
	hdr.Set(hdrHookID, strconv.FormatInt(l.hook, 10))
}

// RedeliverPerMinute is github.redeliver_per_minute: the most
// redeliveries Redeliver asks with this ledger's credential in any minute.
func (l *HookLedger) RedeliverPerMinute() int { return l.redeliveries.n }

// ErrRedeliveryPaced is a redelivery not asked because
// github.redeliver_per_minute were asked in the last minute.
var ErrRedeliveryPaced = errors.New("github.redeliver_per_minute reached; asked later")

// Redeliver asks GitHub to deliver an attempt again (POST
// .../deliveries/{id}/attempts): the webhook comes back through the
// endpoint like any other, with redelivery set. At most
// github.redeliver_per_minute are asked in any minute with one credential;
// past that it returns ErrRedeliveryPaced without asking.
func (l *HookLedger) Redeliver(ctx context.Context, id int64) error {
	if !l.redeliveries.take(time.Now()) {
		return ErrRedeliveryPaced
	}
	if err := l.redeliver(ctx, id); err != nil {
		var accepted *github.AcceptedError // 202: queued by GitHub, which is what was asked
		if errors.As(err, &accepted) {
			return nil
		}
		return l.api.apiError(err)
	}
	return nil
}

// refusesCredential reports whether err is GitHub refusing the ledger's
// credential or hook for good (401, 403 but a rate limit, 404): a problem
// of the hook's configuration, which polling again does not mend.
func refusesCredential(err error) bool {
	var se *githubStatusError
	return errors.Is(err, ErrGitHubUnauthorized) || errors.Is(err, ErrHookTokenRefused) ||
		errors.As(err, &se) && slices.Contains([]int{http.StatusForbidden, http.StatusNotFound}, se.Status)
}

// hookLedgers are the ledgers cfg configures (NewHookLedgers), the App
// read from its key when github.app_id is set.
func hookLedgers(cfg *Config, log *slog.Logger) ([]*HookLedger, error) {
	var app *GitHubApp
	if cfg.GitHub.AppID > 0 {
		var err error
		if app, err = NewGitHubApp(cfg.GitHub, log); err != nil {
			return nil, err
		}
	}
	return NewHookLedgers(cfg.GitHub, app, log)
}
