package main

import (
	"fmt"
	"net"
	"os"
	"strings"
	"time"
)

// TLSConfig is [server.tls]: the endpoint serves HTTPS itself, with a
// certificate it obtains and renews by ACME (acme_domains) or one the
// operator's files hold (cert_file, key_file, read again on SIGHUP).
// Neither: plain HTTP, behind a reverse proxy that ends TLS.
type TLSConfig struct {
	// ACMEDomains are the names the certificate is for.
	ACMEDomains []string `toml:"acme_domains"`
	// ACMEEmail is the ACME account's contact (expiry notices).
	ACMEEmail string `toml:"acme_email"`
	// ACMECA is the ACME directory; Let's Encrypt's production one by
	// default.
	ACMECA string `toml:"acme_ca"`
	// ACMECARoot is a PEM file of the roots the ACME directory's own
	// certificate chains to, for a private CA.
	ACMECARoot string `toml:"acme_ca_root"`
	// CertFile and KeyFile are a certificate chain and its key, PEM.
	CertFile string `toml:"cert_file"`
	KeyFile  string `toml:"key_file"`
	// HTTPListen, when set, is a plain HTTP listener (port 80) that answers
	// ACME's HTTP-01 challenges and sends everything else to HTTPS.
	HTTPListen string `toml:"http_listen"`
	// RenewCheck is how often the certificates are looked at for renewal
	// (10m when 0); each is renewed when a third of its life is left.
	RenewCheck time.Duration `toml:"renew_check"`
}

// letsEncrypt is Let's Encrypt's production ACME directory.
const letsEncrypt = "https://acme-v02.api.letsencrypt.org/directory"

// On reports whether the endpoint serves HTTPS itself.
func (c TLSConfig) On() bool { return c.ACME() || c.CertFile != "" || c.KeyFile != "" }

// ACME reports whether the certificate comes by ACME.
func (c TLSConfig) ACME() bool { return len(c.ACMEDomains) > 0 }

// summary is what check-config prints of c after server.listen.
func (c TLSConfig) summary() string {
	switch {
	case c.ACME():
		s := fmt.Sprintf(" (HTTPS: server.tls.acme_domains = %q, acme_ca = %q", c.ACMEDomains, c.ACMECA)
		if c.HTTPListen != "" {
			s += fmt.Sprintf(", http_listen = %q", c.HTTPListen)
		}
		return s + ")"
	case c.On():
		return fmt.Sprintf(" (HTTPS: server.tls.cert_file = %q, key_file = %q)", c.CertFile, c.KeyFile)
	}
	return " (plain HTTP)"
}

// problems are what cannot work in c, every one at once, each naming its
// key.
func (c TLSConfig) problems() []error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, fmt.Errorf("server.tls.%s: %s", key, fmt.Sprintf(format, args...)))
	}
	files := c.CertFile != "" || c.KeyFile != ""
	switch {
	case c.ACME() && files:
		bad("acme_domains", "and cert_file/key_file both given: a certificate comes by ACME or from files, not both")
	case files && (c.CertFile == "" || c.KeyFile == ""):
		bad("cert_file", "and key_file go together: give both")
	case !c.ACME() && !files && (c.ACMEEmail != "" || c.ACMECARoot != "" || c.HTTPListen != ""):
		bad("acme_domains", "no domain: the certificate is for acme_domains (or give cert_file and key_file)")
	}
	for i, d := range c.ACMEDomains {
		switch {
		case strings.HasPrefix(d, "*."):
			bad(fmt.Sprintf("acme_domains[%d]", i), "%q is a wildcard, which ACME issues only by DNS-01; switchyard answers HTTP-01 and TLS-ALPN-01: name each host (%q), or give cert_file and key_file",
				d, strings.TrimPrefix(d, "*."))
		case !validDomain(d):
			bad(fmt.Sprintf("acme_domains[%d]", i), "%q is not a domain name ACME can issue for", d)
		}
	}
	if c.ACMECA != "" && !strings.HasPrefix(c.ACMECA, "https://") {
		bad("acme_ca", "an ACME directory's https:// URL, got %q", c.ACMECA)
	}
	for _, f := range []struct{ key, path string }{{"cert_file", c.CertFile}, {"acme_ca_root", c.ACMECARoot}} {
		if f.path != "" {
			if _, err := os.ReadFile(f.path); err != nil {
				bad(f.key, "%v", err)
			}
		}
	}
	if c.KeyFile != "" {
		if err := checkKeyFile(c.KeyFile); err != nil {
			bad("key_file", "%v", err)
		}
	}
	if c.RenewCheck < 0 {
		bad("renew_check", "must not be negative (0: every 10m)")
	}
	return errs
}

// warnings are what check-config points out of c: HTTPS that GitHub
// cannot reach, on a loopback listen.
func (c TLSConfig) warnings(listen string) []string {
	host, _, err := net.SplitHostPort(listen)
	if ip := net.ParseIP(host); c.On() && err == nil && (host == "localhost" || ip != nil && ip.IsLoopback()) {
		return []string{fmt.Sprintf("server.tls: HTTPS on server.listen %s, a loopback address GitHub cannot reach: listen = \":443\"", listen)}
	}
	return nil
}

// checkKeyFile refuses a private key that cannot be read, or that anyone
// else may read.
func checkKeyFile(path string) error {
	st, err := os.Stat(path)
	if err != nil {
		return err
	}
	if st.Mode().Perm()&0o004 != 0 {
		return fmt.Errorf("%s is readable by everyone (mode %04o): chmod 0600 it", path, st.Mode().Perm())
	}
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	return f.Close()
}

// validDomain reports whether d is a DNS name that is not an IP address.
func validDomain(d string) bool {
	if d == "" || len(d) > 253 || net.ParseIP(d) != nil || !strings.Contains(d, ".") {
		return false
	}
	for _, label := range strings.Split(d, ".") {
		if label == "" || len(label) > 63 || strings.HasPrefix(label, "-") || strings.HasSuffix(label, "-") {
			return false
		}
		for _, r := range label {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-') {
				return false
			}
		}
	}
	return true
}
