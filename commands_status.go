// `switchyard status`: the running daemon's status read over its API
// (HTTP, or HTTPS with server.tls), and printed for a terminal.

package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// printStatus asks the running daemon for its status (GET /api/v1/status on
// server.listen, with the operator token) and prints it. It returns nil when
// all is well, an error naming each problem when something needs the
// operator (exit 1), and an exitError of exitUnreachable when it cannot read
// the daemon's whole answer (exit 3).
func printStatus(ctx context.Context, cfg *Config, asJSON bool, stdout io.Writer) error {
	base, client, err := daemonClient(cfg.Server)
	if err != nil {
		return err
	}
	url := base + "/api/v1/status"
	unreachable := func(format string, args ...any) error {
		return &exitError{code: exitUnreachable, err: fmt.Errorf(format, args...)}
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+cfg.API.OperatorToken)
	resp, err := client.Do(req)
	if err != nil {
		return unreachable("is switchyard serving on %s? %w", cfg.Server.Listen, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxStatusBytes+1))
	if err != nil {
		return unreachable("GET %s: %w", url, err)
	}
	if len(body) > maxStatusBytes {
		return unreachable("GET %s: the answer is over %d bytes", url, maxStatusBytes)
	}
	if resp.StatusCode != http.StatusOK {
		return unreachable("GET %s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	var st Status
	if err := json.Unmarshal(body, &st); err != nil {
		return unreachable("GET %s: %w", url, err)
	}
	if asJSON {
		if _, err := stdout.Write(body); err != nil {
			return err
		}
	} else {
		writeStatus(stdout, st)
	}
	if len(st.Problems) > 0 {
		return fmt.Errorf("needs the operator: %s", strings.Join(st.Problems, "; "))
	}
	return nil
}

// daemonClient is how a command reaches the API of the daemon that serves
// cfg on this machine: the base URL (server.listen, its loopback address
// when it listens on all) and a client. With server.tls the client speaks
// HTTPS to that address for the certificate's first name, and trusts the
// system's roots (SSL_CERT_FILE adds a private CA's) and cert_file's own
// certificates, so that a self-signed pair is read too.
func daemonClient(cfg ServerConfig) (base string, client *http.Client, err error) {
	host, port, err := net.SplitHostPort(cfg.Listen)
	if err != nil {
		return "", nil, fmt.Errorf("server.listen: %w", err)
	}
	if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	addr := net.JoinHostPort(host, port)
	if !cfg.TLS.On() {
		return "http://" + addr, &http.Client{}, nil
	}
	roots, err := x509.SystemCertPool()
	if err != nil {
		roots = x509.NewCertPool()
	}
	name := ""
	if cfg.TLS.ACME() {
		name = cfg.TLS.ACMEDomains[0]
	} else {
		pair, err := tls.LoadX509KeyPair(cfg.TLS.CertFile, cfg.TLS.KeyFile)
		if err != nil {
			return "", nil, fmt.Errorf("server.tls: load %s and %s: %w", cfg.TLS.CertFile, cfg.TLS.KeyFile, err)
		}
		for _, der := range pair.Certificate {
			if c, err := x509.ParseCertificate(der); err == nil {
				roots.AddCert(c)
			}
		}
		if len(pair.Leaf.DNSNames) > 0 {
			name = pair.Leaf.DNSNames[0]
		}
	}
	dialer := &net.Dialer{Timeout: 10 * time.Second}
	transport := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: name, MinVersion: tls.VersionTLS12},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, network, addr)
		}}
	return "https://" + addr, &http.Client{Transport: transport}, nil
}

// maxStatusBytes bounds the daemon's answer that `status` reads.
const maxStatusBytes = 16 << 20

// writeStatus prints a Status for a terminal.
func writeStatus(w io.Writer, st Status) {
	fmt.Fprintf(w, "switchyard %s (%s), up %s\n", st.Version, st.GoVersion, st.Now.Sub(st.StartedAt).Round(time.Second))
	if st.Draining {
		fmt.Fprintln(w, "draining: told to stop; /readyz answers 503 while the node still answers what reaches it")
	}
	for _, b := range st.Brokers {
		if b.Active {
			fmt.Fprintf(w, "active broker: #%d %s vhost %s\n", b.Index, b.Host, b.Vhost)
		}
	}
	if p := st.Pending; p != nil {
		fmt.Fprintf(w, "pending switch: to #%d (%s vhost %s), switched at %s\n", p.Index, p.Host, p.Vhost, p.SwitchedAt.Format(time.RFC3339))
		for _, h := range p.HeldBy {
			fmt.Fprintf(w, "  waits for %s on #%d: %s\n", h.Queue, h.Broker, plural(h.Messages, "message"))
		}
	} else {
		fmt.Fprintln(w, "pending switch: none")
	}
	fmt.Fprintf(w, "messages in -error queues: %d\n", st.ErrorMessages)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "\nBROKER\tUP\tROLE\tNON-EMPTY QUEUES")
	for _, b := range st.Brokers {
		var held []string
		for _, q := range allQueues() {
			if n := b.Queues[q].Ready; n > 0 {
				held = append(held, fmt.Sprintf("%s=%d", q, n))
			}
		}
		up := "up"
		if !b.Up {
			up, held = "down", []string{b.Error}
		}
		fmt.Fprintf(tw, "#%d %s vhost %s\t%s\t%s\t%s\n", b.Index, b.Host, b.Vhost, up, b.Role(), strings.Join(held, " "))
	}
	fmt.Fprintln(tw, "\nWORKER\tLAST CYCLE\tLAST STORED\tFAILURES")
	for _, wk := range st.Workers {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d %s\n", wk.Name, lastCycle(st.Now, wk), ago(st.Now, wk.LastStored), wk.Failures, wk.LastError)
	}
	tw.Flush()
	if len(st.Budgets) > 0 {
		fmt.Fprintln(tw, "\nBROKER\tPUBLISHED\tDELIVERED\tMONTHLY QUOTA\tUSED\tPROJECTED\tRUNS OUT")
		for _, v := range st.Budgets {
			quota, used, out := "none", "-", "-"
			if v.Monthly > 0 {
				quota, used = strconv.FormatInt(v.Monthly, 10), fmt.Sprintf("%.1f%%", 100*v.UsedRatio)
			}
			if !v.RunsOut.IsZero() {
				out = v.RunsOut.Format("2006-01-02")
			}
			fmt.Fprintf(tw, "#%d\t%d\t%d\t%s\t%s\t%s\t%s\n", v.Broker, v.Published, v.Delivered, quota, used, v.ProjectionText(), out)
		}
		tw.Flush()
		fmt.Fprintln(w, "  (a webhook is one publish and two deliveries: github and github-database; PROJECTED is the month's end at the last 24 hours' rate, once a day is counted)")
	}
	if len(st.Nodes) > 0 {
		fmt.Fprintln(tw, "\nNODE\tVERSION\tSTARTED\tLAST SEEN\tLEASES")
		for _, n := range st.Nodes {
			name, seen := n.Name, ago(st.Now, n.SeenAt)
			if n.Name == st.Node {
				name += " (this one)"
			}
			if n.Gone {
				seen += " (gone)"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", name, n.Version, n.StartedAt.Format(time.RFC3339), seen, strings.Join(n.Leases, " "))
		}
		tw.Flush()
	}
	writeOutbox(w, st)
	for _, c := range st.Certificates {
		renewed := "files (server.tls.cert_file)"
		if c.ACME {
			renewed = "renewed by ACME"
		}
		fmt.Fprintf(w, "certificate: %s, by %s, expires %s (%s)\n", strings.Join(c.Names, " "), c.Issuer, c.NotAfter.Format(time.RFC3339), renewed)
	}
	if f := forbiddenRead(st.Now, st.Workers); f != "" {
		fmt.Fprintf(w, "github-forbidden: %s\n", f)
	}
	total := 0
	for _, b := range st.Statistics {
		total += b.Count
	}
	fmt.Fprintf(w, "\nevents in the last 7 days: %d\ndatabase: %s, %d bytes, %d raw rows\nopen delivery gaps: %d (%d unrecoverable)\n",
		total, st.Database.Path, st.Database.SizeBytes, st.Database.Rows["github"], st.GapsTotal, st.Unrecoverable)
	if at := st.Database.Unprepared; at != nil {
		fmt.Fprintf(w, "database: a pooler in transaction mode found %s: statements run unprepared; add default_query_exec_mode=exec to database.url\n",
			at.Format(time.RFC3339))
	}
	for _, g := range st.Gaps {
		state := ""
		if g.UnrecoverableAt != nil {
			state = " (unrecoverable)"
		}
		fmt.Fprintf(w, "  %s %s hook %s delivered %s%s\n", g.GUID, g.Event, hookName(g.Hook), g.DeliveredAt.Format(time.RFC3339), state)
	}
	for _, l := range st.Ledgers {
		state := "answers"
		if l.Refused != "" {
			state = "REFUSED by GitHub: " + l.Refused
		}
		cp := "not polled yet"
		if l.Checkpoint != nil {
			cp = "polled to " + l.Checkpoint.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(w, "delivery ledger of %s: %s, %s, %s\n", l.Name, state, cp, plural(l.OpenGaps, "open gap"))
	}
	if st.GapsTotal > len(st.Gaps) {
		fmt.Fprintf(w, "  ... the newest %d of %d listed; switchyard deliveries -gaps for more\n", len(st.Gaps), st.GapsTotal)
	}
	if len(st.Problems) == 0 {
		fmt.Fprintln(w, "\nall is well")
		return
	}
	fmt.Fprintln(w, "\nneeds the operator:")
	for _, p := range st.Problems {
		fmt.Fprintf(w, "  %s\n", p)
	}
}

// writeOutbox prints what waits in the outbox for the broker, what the
// broker refused for good, and the webhooks of the last hour refused.
func writeOutbox(w io.Writer, st Status) {
	ob := st.Outbox
	full := ""
	if ob.Full {
		full = fmt.Sprintf(" (this node's full: %d of %d bytes; webhooks go to the broker directly)", ob.Waiting, ob.MaxBytes)
	}
	if ob.Messages == 0 {
		fmt.Fprintf(w, "\noutbox: nothing waits for the broker%s\n", full)
	} else {
		since := ""
		if ob.Oldest != nil {
			since = " since " + ob.Oldest.Format(time.RFC3339)
		}
		fmt.Fprintf(w, "\noutbox: %s (%d bytes) waiting for the broker%s, forwarded by %s%s\n", plural(int(ob.Messages), "webhook"), ob.Bytes,
			since, strings.Join(ob.Nodes, ", "), full)
	}
	if ob.RefusedCount > 0 {
		fmt.Fprintf(w, "  refused by the broker for good: %s (switchyard outbox retry sends them again)\n", plural(int(ob.RefusedCount), "webhook"))
		for _, r := range ob.Refused {
			fmt.Fprintf(w, "    %s %s %s, %d bytes: %s\n", r.RefusedAt.Format(time.RFC3339), r.GUID, r.Event, r.Bytes, r.Reason)
		}
	}
	for _, r := range st.Refused {
		fmt.Fprintf(w, "  refused in the last hour: %d with %d (%s)\n", r.Count, r.Status, r.Reason)
	}
}
