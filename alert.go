package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	mail "github.com/wneessen/go-mail"
)

// Alerter sends the alerts: rules select Events by "event.action"
// patterns, and name the channels (email, push) that announce them.
type Alerter struct {
	cfg  atomic.Pointer[AlertsConfig] // a SIGHUP may change it
	http *http.Client
	log  *slog.Logger
}

// NewAlerter returns the alerter of cfg; with no rule it sends nothing.
func NewAlerter(cfg AlertsConfig, log *slog.Logger) *Alerter {
	a := &Alerter{http: &http.Client{Timeout: 15 * time.Second}, log: log}
	a.Reload(cfg)
	return a
}

// Reload takes new rules and channels (SIGHUP); the next alert uses them.
func (a *Alerter) Reload(cfg AlertsConfig) {
	a.cfg.Store(&cfg)
}

// matchPattern matches "event.action" against a rule pattern: "*" matches
// all, "pull_request.*" every action of an event, "issues.opened" one action,
// and a bare "push" an event with any or no action.
func matchPattern(pattern, event, action string) bool {
	if pattern == "*" {
		return true
	}
	pe, pa, hasAction := strings.Cut(pattern, ".")
	if pe != event {
		return false
	}
	if !hasAction || pa == "*" {
		return true
	}
	return pa == action
}

// AlertIntent is what an alert is about, as the rules match it: an Event's
// name and action, or switchyard's own ("gap" with the missing delivery's
// event, "gap" "unrecoverable").
type AlertIntent struct{ Name, Action string }

// Channels returns the channels that must announce ev, in a stable order.
func (a *Alerter) Channels(ev *Event) []string {
	return a.ChannelsFor(AlertIntent{Name: ev.Name, Action: ev.Action})
}

// ChannelsFor returns the channels that must announce in, in a stable
// order. A rule without channels means every configured channel.
func (a *Alerter) ChannelsFor(in AlertIntent) []string {
	if a == nil {
		return nil
	}
	var out []string
	for _, r := range a.cfg.Load().Rules {
		matched := false
		for _, p := range r.Events {
			if matchPattern(p, in.Name, in.Action) {
				matched = true
				break
			}
		}
		if !matched {
			continue
		}
		chans := r.Channels
		if len(chans) == 0 {
			chans = a.configured()
		}
		for _, c := range chans {
			if !slices.Contains(out, c) {
				out = append(out, c)
			}
		}
	}
	slices.Sort(out)
	return out
}

func (a *Alerter) configured() []string {
	var c []string
	cfg := a.cfg.Load()
	if cfg.Email.Host != "" {
		c = append(c, "email")
	}
	if cfg.Push.URL != "" {
		c = append(c, "push")
	}
	return c
}

// alertLink finds the page a person would open for the Event.
func alertLink(payload []byte) string {
	var p struct {
		PullRequest *struct {
			HTMLURL string `json:"html_url"`
		} `json:"pull_request"`
		Issue *struct {
			HTMLURL string `json:"html_url"`
		} `json:"issue"`
		Comment *struct {
			HTMLURL string `json:"html_url"`
		} `json:"comment"`
		Discussion *struct {
			HTMLURL string `json:"html_url"`
		} `json:"discussion"`
		Release *struct {
			HTMLURL string `json:"html_url"`
		} `json:"release"`
		CheckRun *struct {
			HTMLURL string `json:"html_url"`
		} `json:"check_run"`
		WorkflowRun *struct {
			HTMLURL string `json:"html_url"`
		} `json:"workflow_run"`
		Compare    string `json:"compare"`
		Repository *struct {
			HTMLURL string `json:"html_url"`
		} `json:"repository"`
	}
	if json.Unmarshal(payload, &p) != nil {
		return ""
	}
	for _, u := range []*struct {
		HTMLURL string `json:"html_url"`
	}{p.Comment, p.PullRequest, p.Issue, p.Discussion, p.Release, p.CheckRun, p.WorkflowRun} {
		if u != nil && u.HTMLURL != "" {
			return u.HTMLURL
		}
	}
	if p.Compare != "" {
		return p.Compare
	}
	if p.Repository != nil {
		return p.Repository.HTMLURL
	}
	return ""
}

// alertText is what a person reads: what happened, where, by whom, and a link.
func alertText(ev *Event, forbidden bool) (subject, body, link string) {
	switch ev.Name {
	case "gap":
		return gapText(ev)
	case "unrecoverable":
		return unrecoverableText(ev)
	case "budget":
		return budgetText(ev)
	case "blocked":
		return blockedText(ev)
	case "ledger":
		return ledgerText(ev)
	}
	what := ev.Name
	if ev.Action != "" {
		what += "." + ev.Action
	}
	where := ev.Repository
	if where == "" {
		where = "GitHub"
	}
	subject = fmt.Sprintf("%s on %s", what, where)
	if ev.Sender != "" {
		subject += " by " + ev.Sender
	}
	if forbidden {
		subject = "[Forbidden] " + subject
	}
	link = alertLink(ev.Payload)
	var b strings.Builder
	fmt.Fprintf(&b, "Event:      %s\n", ev.Name)
	if ev.Action != "" {
		fmt.Fprintf(&b, "Action:     %s\n", ev.Action)
	}
	fmt.Fprintf(&b, "Repository: %s\n", where)
	if ev.Sender != "" {
		fmt.Fprintf(&b, "By:         %s\n", ev.Sender)
	}
	if link != "" {
		fmt.Fprintf(&b, "Link:       %s\n", link)
	}
	fmt.Fprintf(&b, "Delivery:   %s\nReceived:   %s\n", ev.DeliveryID, ev.ReceivedAt.UTC().Format(time.RFC3339))
	if forbidden {
		fmt.Fprintf(&b, "\nThis delivery came from %s, outside the allowed GitHub ranges.\n", ev.SourceIP)
	}
	return subject, b.String(), link
}

// gapText announces a delivery gap: ev.Action is the missing delivery's
// event, ev.ReceivedAt when GitHub delivered it.
func gapText(ev *Event) (subject, body, link string) {
	subject = fmt.Sprintf("Delivery gap: %s %s delivered by GitHub, not stored", ev.Action, ev.DeliveryID)
	body = fmt.Sprintf(`GitHub delivered this webhook and got a 2xx answer, but it is not stored.

Delivery:   %s
Event:      %s
Delivered:  %s

It may have been lost by a broker, be waiting on a broker nobody reads, or
sit in an -error queue. switchyard asks GitHub to deliver it again when
github.redeliver_gaps is on; "switchyard deliveries -gaps" lists the open gaps,
and docs/ledger.md (with the README) says what to do about one.
`, ev.DeliveryID, ev.Action, ev.ReceivedAt.UTC().Format(time.RFC3339))
	return subject, body, ""
}

// unrecoverableText announces a gap given up on: ev.Action is the missing
// delivery's event, ev.Payload why.
func unrecoverableText(ev *Event) (subject, body, link string) {
	subject = fmt.Sprintf("Delivery gap unrecoverable: %s %s", ev.Action, ev.DeliveryID)
	body = fmt.Sprintf(`switchyard gave up on this delivery gap: it will not ask GitHub for it again.

Delivery:   %s
Event:      %s
Delivered:  %s
Why:        %s

GitHub refused its redelivery three times (it no longer has the delivery, or
will not deliver it again), or its API described it in a way no message may
carry. What it held is lost unless its source sends it again;
"switchyard deliveries -gaps" lists the gaps.
`, ev.DeliveryID, ev.Action, ev.ReceivedAt.UTC().Format(time.RFC3339), ev.Payload)
	return subject, body, ""
}

// budgetText announces a broker passing its budget: ev.DeliveryID is
// "budget:HOST/VHOST:MONTH-START:LEVEL".
func budgetText(ev *Event) (subject, body, link string) {
	rest := strings.TrimPrefix(ev.DeliveryID, "budget:")
	level := rest[strings.LastIndex(rest, ":")+1:]
	rest = strings.TrimSuffix(rest, ":"+level)
	month := rest[strings.LastIndex(rest, ":")+1:]
	broker := strings.TrimSuffix(rest, ":"+month)
	what := "has spent its warning share of"
	switch level {
	case "exhausted":
		what = "has spent all of"
	case "none":
		subject = "Broker budget: no broker is left under queue.rotate_at"
		body = fmt.Sprintf("The broker switchyard publishes to is out of budget, and no other broker is under\nqueue.rotate_at and answering, in the budget month that began %s: publishing stays where it is.\nRaise a plan, add a broker, or move the producer by hand.\n", month)
		return subject, body, ""
	}
	subject = fmt.Sprintf("Broker budget: %s %s its monthly messages", broker, what)
	body = fmt.Sprintf(`The broker %s %s its monthly_messages in the budget month that began %s.

A free plan that runs out blocks or refuses the connection: webhooks then get 503.
/status shows each broker's use and the month-end projection; move the producer to
another broker, or raise the plan.
`, broker, what, month)
	return subject, body, ""
}

// ledgerText announces a hook's ledger that GitHub refuses: ev.DeliveryID
// is "ledger:HOOK since TIME because REASON" (ledgerAlertID).
func ledgerText(ev *Event) (subject, body, link string) {
	hook, rest, _ := strings.Cut(strings.TrimPrefix(ev.DeliveryID, "ledger:"), " since ")
	since, reason, _ := strings.Cut(rest, " because ")
	subject = fmt.Sprintf("Delivery ledger: GitHub refuses %s's", hook)
	body = fmt.Sprintf(`GitHub refused to list the deliveries of %s since %s: %s.

Until it answers, failed deliveries of that hook are not replayed and its gaps are
not found; the other hooks' ledgers go on. Check the hook's token in
[[github.hooks]] (a fine-grained token with the Webhooks permission, read and write,
on its repository or organization), or the App's installation there, and the hook's
ID. "switchyard status" shows the problem while it holds.
`, hook, since, reason)
	return subject, body, ""
}

// blockedText announces a broker blocking switchyard's connection: ev.DeliveryID
// is "blocked:HOST/VHOST since TIME because REASON" (blockedAlertID).
func blockedText(ev *Event) (subject, body, link string) {
	broker, rest, _ := strings.Cut(strings.TrimPrefix(ev.DeliveryID, "blocked:"), " since ")
	since, reason, _ := strings.Cut(rest, " because ")
	subject = fmt.Sprintf("Broker blocked: %s blocks publishing (%s)", broker, reason)
	body = fmt.Sprintf(`The broker %s blocked switchyard's connection at %s: %s.

While it blocks, webhooks are answered 503 with Retry-After, and GitHub records
them as failed; the hooks worker has GitHub deliver them again once a broker
takes them. A broker blocks when it runs low on memory or disk, or when a plan's
quota is spent. With queue.rotate_on_budget, a block longer than
queue.blocked_rotate_after moves publishing to the next broker under budget.
/status shows the block while it holds.
`, broker, since, reason)
	return subject, body, ""
}

// Send announces ev on one channel.
func (a *Alerter) Send(ctx context.Context, channel string, ev *Event, forbidden bool) error {
	subject, body, link := alertText(ev, forbidden)
	switch channel {
	case "email":
		return a.sendEmail(ctx, subject, body)
	case "push":
		return a.sendPush(ctx, subject, body, link, ev)
	}
	return fmt.Errorf("unknown alert channel %q", channel)
}

func (a *Alerter) sendEmail(ctx context.Context, subject, body string) error {
	c := a.cfg.Load().Email
	if c.Host == "" {
		return fmt.Errorf("email alert: alerts.email.host is not set")
	}
	m := mail.NewMsg()
	if err := m.From(c.From); err != nil {
		return fmt.Errorf("email alert: from: %w", err)
	}
	if err := m.To(c.To...); err != nil {
		return fmt.Errorf("email alert: to: %w", err)
	}
	m.Subject(subject)
	m.SetBodyString(mail.TypeTextPlain, body)

	opts := []mail.Option{mail.WithPort(c.Port), mail.WithTimeout(15 * time.Second)}
	switch c.TLS {
	case "tls":
		opts = append(opts, mail.WithSSL())
	case "none":
		opts = append(opts, mail.WithTLSPolicy(mail.NoTLS))
	default: // starttls
		opts = append(opts, mail.WithTLSPolicy(mail.TLSMandatory))
	}
	if c.Username != "" {
		opts = append(opts, mail.WithSMTPAuth(mail.SMTPAuthPlain), mail.WithUsername(c.Username), mail.WithPassword(c.Password))
	}
	client, err := mail.NewClient(c.Host, opts...)
	if err != nil {
		return fmt.Errorf("email alert: %w", err)
	}
	if err := client.DialAndSendWithContext(ctx, m); err != nil {
		return fmt.Errorf("email alert via %s:%d: %w", c.Host, c.Port, err)
	}
	return nil
}

// sendPush POSTs an ntfy-style message: the body as text, the title, tags
// and link as headers.
func (a *Alerter) sendPush(ctx context.Context, title, body, link string, ev *Event) error {
	push := a.cfg.Load().Push
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, push.URL, bytes.NewBufferString(body))
	if err != nil {
		return fmt.Errorf("push alert: %w", err)
	}
	req.Header.Set("Content-Type", "text/plain; charset=utf-8")
	req.Header.Set("Title", title)
	tags := []string{"github", ev.Name}
	if ev.Action != "" {
		tags = append(tags, ev.Action)
	}
	if strings.HasPrefix(title, "[Forbidden]") {
		tags = append(tags, "warning")
	}
	req.Header.Set("Tags", strings.Join(tags, ","))
	if link != "" {
		req.Header.Set("Click", link)
	}
	if push.Token != "" {
		req.Header.Set("Authorization", "Bearer "+push.Token)
	}
	resp, err := a.http.Do(req)
	if err != nil {
		return fmt.Errorf("push alert to %s: %w", req.URL.Host, err)
	}
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("push alert: %s answered %d", req.URL.Host, resp.StatusCode)
	}
	return nil
}
