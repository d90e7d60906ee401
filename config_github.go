package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"
)

// The [github] section: GitHub's hooks, the App, and the delivery ledgers
// of every hook; what check-config holds them to.

// GitHubConfig is everything switchyard knows of GitHub.
type GitHubConfig struct {
	WebhookSecret          string   `toml:"webhook_secret"`
	PreviousWebhookSecrets []string `toml:"previous_webhook_secrets"`
	// Hooks are the hooks that keep a secret of their own: a webhook whose
	// X-GitHub-Hook-ID is listed is verified with its secrets only.
	Hooks          []HookConfig `toml:"hooks"`
	AllowedCIDRs   []string     `toml:"allowed_cidrs"`
	MetaFile       string       `toml:"meta_file"`
	BotAppID       int64        `toml:"bot_app_id"`
	AppID          int64        `toml:"app_id"`
	PrivateKeyFile string       `toml:"private_key_file"`
	APIURL         string       `toml:"api_url"`
	// ReconcileGrace is how long a delivery GitHub made with a 2xx may take
	// to be stored (the retry cycle) before the hooks poll calls it a gap.
	ReconcileGrace time.Duration `toml:"reconcile_grace"`
	// DeliveryWindow is how far back GitHub keeps a hook's deliveries (3
	// days on github.com, 7 on GitHub Enterprise Server): the ledger reads
	// no further.
	DeliveryWindow time.Duration `toml:"delivery_window"`
	// RedeliverGaps asks GitHub to deliver a gap again.
	RedeliverGaps bool `toml:"redeliver_gaps"`
	// MaxPagesPerPoll bounds the pages of deliveries one poll (and the
	// deliveries command) reads; the next poll goes on from the checkpoint.
	MaxPagesPerPoll int `toml:"max_pages_per_poll"`
	// RedeliverPerMinute bounds the redeliveries asked of GitHub, whose
	// content-creation limit is 80 a minute for everything the App does.
	RedeliverPerMinute int `toml:"redeliver_per_minute"`
}

// HookConfig is one [[github.hooks]] entry: a GitHub hook (a repository
// or organization webhook, or an App's), the secret it signs with, and,
// for a repository's or an organization's webhook, where GitHub keeps its
// deliveries and the token that reads them (its delivery ledger).
type HookConfig struct {
	ID              int64    `toml:"id"`
	Secret          string   `toml:"secret"`
	PreviousSecrets []string `toml:"previous_secrets"`
	// Repository ("OWNER/NAME") or Organization is where the webhook is
	// set: its deliveries are read there. Token reads them (a fine-grained
	// token with Webhooks read and write); without it, the App's
	// installation token there.
	Repository   string `toml:"repository"`
	Organization string `toml:"organization"`
	Token        string `toml:"token"`
}

// HasLedgers reports whether g keeps any hook's delivery ledger: the
// App's own hook's, or a repository's or an organization's webhook's.
func (g *GitHubConfig) HasLedgers() bool {
	return g.AppID > 0 || slices.ContainsFunc(g.Hooks, func(h HookConfig) bool { return h.Repository != "" || h.Organization != "" })
}

// githubRedeliveryWindow is how long GitHub keeps a delivery and can deliver
// it again: a payload or identity pruned sooner would let a redelivery
// count twice, or the ledger call a stored delivery a gap.
const githubRedeliveryWindow = 72 * time.Hour

// maxDeliveryWindow is the longest github.delivery_window: GitHub
// Enterprise Server keeps a hook's deliveries 7 days.
const maxDeliveryWindow = 7 * 24 * time.Hour

// validOwner reports whether s may be a GitHub login (a user's or an
// organization's): letters, digits and single hyphens, at most 39.
func validOwner(s string) bool {
	if s == "" || len(s) > 39 || s[0] == '-' || s[len(s)-1] == '-' || strings.Contains(s, "--") {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-') {
			return false
		}
	}
	return true
}

// validRepository reports whether s is OWNER/NAME: a login, and a
// repository name of letters, digits, '.', '-' and '_' (at most 100).
func validRepository(s string) bool {
	owner, name, ok := strings.Cut(s, "/")
	if !ok || !validOwner(owner) || name == "" || len(name) > 100 || name == "." || name == ".." {
		return false
	}
	for _, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '-' || r == '_') {
			return false
		}
	}
	return true
}

// check holds the [github] section to its rules, saying each
// failure through bad.
func (g *GitHubConfig) check(bad func(field, format string, args ...any)) {
	if strings.TrimSpace(g.WebhookSecret) == "" {
		bad("github.webhook_secret", "required, and more than spaces")
	}
	for i, s := range g.PreviousWebhookSecrets {
		if strings.TrimSpace(s) == "" {
			bad(fmt.Sprintf("github.previous_webhook_secrets[%d]", i), "empty or only spaces")
		}
	}
	seen := map[int64]bool{}
	for i, h := range g.Hooks {
		field := fmt.Sprintf("github.hooks[%d]", i)
		switch {
		case h.ID <= 0:
			bad(field+".id", "required: the hook's X-GitHub-Hook-ID (its ID in the hook's settings URL)")
		case seen[h.ID]:
			bad(field+".id", "hook %d is listed twice", h.ID)
		}
		seen[h.ID] = true
		ledger := h.Repository != "" || h.Organization != ""
		if strings.TrimSpace(h.Secret) == "" && (!ledger || h.Secret != "") {
			bad(field+".secret", "required, and more than spaces (a repository's or organization's hook may leave it out: github.webhook_secret verifies it)")
		}
		switch {
		case h.Repository != "" && h.Organization != "":
			bad(field, "repository and organization both set: a hook is one repository's or one organization's")
		case h.Token != "" && !ledger:
			bad(field+".token", "set without repository or organization: say where the hook is, whose deliveries the token reads")
		case h.Repository != "" && !validRepository(h.Repository):
			bad(field+".repository", "want OWNER/NAME, got %q", h.Repository)
		case h.Organization != "" && !validOwner(h.Organization):
			bad(field+".organization", "want an organization's login, got %q", h.Organization)
		case ledger && h.Token == "" && g.AppID == 0:
			bad(field+".token", "required for the hook's delivery ledger without the App (github.app_id): "+
				"a fine-grained token with the Webhooks permission (read and write) on the repository or organization")
		}
		if h.Token != "" && strings.TrimSpace(h.Token) != h.Token {
			bad(field+".token", "has spaces around it")
		}
		for j, s := range h.PreviousSecrets {
			if strings.TrimSpace(s) == "" {
				bad(fmt.Sprintf("%s.previous_secrets[%d]", field, j), "empty or only spaces")
			}
		}
	}
	for i, p := range g.AllowedCIDRs {
		if _, err := parsePrefix(p); err != nil {
			bad(fmt.Sprintf("github.allowed_cidrs[%d]", i), "%v", err)
		}
	}
	if g.MetaFile != "" {
		if _, err := loadMetaHooks(g.MetaFile); err != nil {
			bad("github.meta_file", "%v", err)
		}
	}
	if g.BotAppID < 0 {
		bad("github.bot_app_id", "must not be negative")
	}
	if g.AppID < 0 {
		bad("github.app_id", "must not be negative")
	}
	if g.AppID > 0 && g.PrivateKeyFile == "" {
		bad("github.private_key_file", "required when github.app_id is set")
	}
	if u, err := url.Parse(g.APIURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		bad("github.api_url", "want an http(s) URL, got %q", g.APIURL)
	}
	if g.MaxPagesPerPoll < 1 || g.MaxPagesPerPoll > 10000 {
		bad("github.max_pages_per_poll", "want 1 to 10000, got %d", g.MaxPagesPerPoll)
	}
	if g.RedeliverPerMinute < 1 || g.RedeliverPerMinute > 80 {
		bad("github.redeliver_per_minute", "want 1 to 80 (GitHub's content-creation limit), got %d", g.RedeliverPerMinute)
	}
	if w := g.DeliveryWindow; w < time.Hour || w > maxDeliveryWindow {
		bad("github.delivery_window", "want 1h to %s (GitHub keeps 72h of deliveries, GitHub Enterprise Server 7 days), got %s", maxDeliveryWindow, w)
	}
	if g.ReconcileGrace <= 0 || g.ReconcileGrace >= g.DeliveryWindow {
		bad("github.reconcile_grace", "want more than 0 and less than github.delivery_window (%s), got %s", g.DeliveryWindow, g.ReconcileGrace)
	}
}

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

// githubHooksCIDRs are the "hooks" ranges of GitHub's /meta endpoint: the
// allow list when neither allowed_cidrs nor meta_file is configured.
var githubHooksCIDRs = []string{
	"192.30.252.0/22",
	"185.199.108.0/22",
	"140.82.112.0/20",
	"143.55.64.0/20",
	"2a0a:a440::/29",
	"2606:50c0::/32",
}

// parsePrefix accepts a CIDR or a bare address (a /32 or /128).
func parsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("not a CIDR: %q", s)
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("not an address or CIDR: %q", s)
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// coversGitHubHooks reports whether cidrs take in every range of GitHub's
// hooks (githubHooksCIDRs): each of GitHub's ranges lies within one of them.
func coversGitHubHooks(cidrs []string) bool {
	var set []netip.Prefix
	for _, c := range cidrs {
		p, err := parsePrefix(c)
		if err != nil {
			return false
		}
		set = append(set, p)
	}
	for _, g := range githubHooksCIDRs {
		p, err := parsePrefix(g)
		if err != nil {
			return false
		}
		if !slices.ContainsFunc(set, func(s netip.Prefix) bool { return s.Bits() <= p.Bits() && s.Contains(p.Addr()) }) {
			return false
		}
	}
	return true
}
