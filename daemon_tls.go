// HTTPS served by the daemon itself (server.tls): a certificate obtained
// and renewed by ACME through certmagic, kept in the store, or the
// operator's files, read again on SIGHUP.

package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
)

// serverTLS is how the endpoint serves HTTPS: the listener's tls.Config,
// with the certificate by ACME (magic) or from files (pair).
//
// By ACME, serving and ordering are apart. Every node serves what the
// store holds: Load caches the certificate of each name as the store has
// it, and the issuer answers ACME's challenges whichever node the CA
// reaches (certmagic keeps the answers in the store). Ordering and
// renewing is the job of the node that holds the acme lease (Order),
// acting through the holding it is handed.
type serverTLS struct {
	cfg    TLSConfig
	config *tls.Config
	log    *slog.Logger
	// ACME: the certificates served and their config, the issuer that
	// answers challenges, and the template prepare makes it of once the
	// listeners are known.
	cache    *certmagic.Cache
	magic    *certmagic.Config
	issuer   *certmagic.ACMEIssuer
	template *certmagic.ACMEIssuer
	storage  certmagic.Storage
	logger   *zap.Logger
	// stored is signalled when this node stored a certificate: Load reads
	// it at once.
	stored chan struct{}
	// Files: the pair last read.
	pair atomic.Pointer[tls.Certificate]
}

// renewCheckEvery is how often certmagic looks for certificates to renew
// (certmagic.DefaultRenewCheckInterval), and how often a node reads the
// store for a certificate another node renewed; server.tls.renew_check
// when set.
const renewCheckEvery = 10 * time.Minute

// newServerTLS prepares HTTPS as cfg says: the files read, or certmagic's
// config over the store. Nothing is ordered or loaded until the jobs run.
func newServerTLS(cfg TLSConfig, store *Store, log *slog.Logger) (*serverTLS, error) {
	t := &serverTLS{cfg: cfg, log: log.With("component", "tls"), stored: make(chan struct{}, 1)}
	if !cfg.ACME() {
		if err := t.Reload(); err != nil {
			return nil, err
		}
		t.config = &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"},
			GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return t.pair.Load(), nil }}
		return t, nil
	}
	t.logger = zap.New(slogCore{log: t.log})
	t.storage = store.CertStorage()
	t.cache, t.magic = t.newMagic(certmagic.Config{})
	t.config = t.magic.TLSConfig()
	t.config.MinVersion = tls.VersionTLS12
	if !slices.Contains(t.config.NextProtos, "h2") {
		t.config.NextProtos = append([]string{"h2"}, t.config.NextProtos...)
	}
	return t, nil
}

// renewCheck is server.tls.renew_check, or renewCheckEvery.
func (t *serverTLS) renewCheck() time.Duration {
	if t.cfg.RenewCheck > 0 {
		return t.cfg.RenewCheck
	}
	return renewCheckEvery
}

// newMagic is a certmagic config like base over the store, with a cache
// of its own.
func (t *serverTLS) newMagic(base certmagic.Config) (*certmagic.Cache, *certmagic.Config) {
	var magic *certmagic.Config
	cache := certmagic.NewCache(certmagic.CacheOptions{
		GetConfigForCert:   func(certmagic.Certificate) (*certmagic.Config, error) { return magic, nil },
		RenewCheckInterval: t.renewCheck(), Logger: t.logger})
	base.Storage, base.Logger = t.storage, t.logger
	magic = certmagic.New(cache, base)
	return cache, magic
}

// Reload reads the certificate files again (SIGHUP); with ACME it does
// nothing. A pair that does not load leaves the one served.
func (t *serverTLS) Reload() error {
	if t.cfg.ACME() {
		return nil
	}
	pair, err := tls.LoadX509KeyPair(t.cfg.CertFile, t.cfg.KeyFile)
	if err != nil {
		return fmt.Errorf("server.tls: load %s and %s: %w", t.cfg.CertFile, t.cfg.KeyFile, err)
	}
	t.pair.Store(&pair)
	return nil
}

// prepare makes the ACME issuer for the listeners: TLS-ALPN-01 answered on
// the HTTPS listener at api, HTTP-01 on the plain one at plain ("" without
// one): certmagic finds their ports taken and leaves the answers to the
// servers on them. It orders nothing; call it before the plain listener's
// handler is made (plainHandler answers HTTP-01 through the issuer), and
// before the jobs run.
func (t *serverTLS) prepare(api, plain string) error {
	if !t.cfg.ACME() {
		return nil
	}
	template := certmagic.ACMEIssuer{CA: t.cfg.ACMECA, Email: t.cfg.ACMEEmail, Agreed: true, Logger: t.logger,
		DisableHTTPChallenge: plain == ""}
	host, port, err := net.SplitHostPort(api)
	if err != nil {
		return err
	}
	template.ListenHost, template.AltTLSALPNPort = host, atoi(port)
	if plain != "" {
		_, port, _ := net.SplitHostPort(plain)
		template.AltHTTPPort = atoi(port)
	}
	if t.cfg.ACMECARoot != "" {
		pem, err := os.ReadFile(t.cfg.ACMECARoot)
		if err != nil {
			return fmt.Errorf("server.tls.acme_ca_root: %w", err)
		}
		template.TrustedRoots = x509.NewCertPool()
		if !template.TrustedRoots.AppendCertsFromPEM(pem) {
			return fmt.Errorf("server.tls.acme_ca_root: %s holds no PEM certificate", t.cfg.ACMECARoot)
		}
	}
	t.template = &template
	t.issuer = certmagic.NewACMEIssuer(t.magic, template)
	t.magic.Issuers = []certmagic.Issuer{t.issuer}
	return nil
}

// Order is the acme lease's job: it obtains the certificate of
// acme_domains when the store has none and renews it (at a third of its
// life left, or when the CA's renewal information says), storing it for
// every node, until ctx ends with the holding. It asks held right before
// each order it sends the CA; the certmagic config and cache that order
// live only as long as the holding, so a node that lost the lease renews
// nothing.
func (t *serverTLS) Order(ctx context.Context, held Holding) error {
	if t.template == nil {
		<-ctx.Done() // prepare failed, and said so
		return nil
	}
	cache, magic := t.newMagic(certmagic.Config{OnEvent: func(_ context.Context, event string, _ map[string]any) error {
		switch event {
		case "cert_obtaining":
			return held.Check()
		case "cert_obtained":
			select {
			case t.stored <- struct{}{}:
			default:
			}
		}
		return nil
	}})
	defer cache.Stop()
	magic.Issuers = []certmagic.Issuer{certmagic.NewACMEIssuer(magic, *t.template)}
	if err := magic.ManageAsync(ctx, t.cfg.ACMEDomains); err != nil {
		return err
	}
	<-ctx.Done()
	return nil
}

// Load is every node's job with ACME: it serves the certificate of each
// name as the store holds it, read every renew_check (every second while
// a name has none), and at once when this node stored one.
func (t *serverTLS) Load(ctx context.Context) error {
	if t.issuer == nil {
		<-ctx.Done()
		return nil
	}
	served := map[string]servedCert{}
	for {
		every := t.renewCheck()
		for _, name := range t.cfg.ACMEDomains {
			next, err := t.load(ctx, name, served[name])
			if err != nil && !errors.Is(err, fs.ErrNotExist) && ctx.Err() == nil {
				t.log.Warn("the certificate not read from the store", "name", name, "error", err)
			}
			if next.hash == "" {
				every = min(every, time.Second)
			}
			served[name] = next
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.stored:
		case <-time.After(every):
		}
	}
}

// servedCert is the certificate served for a name: its PEM as the store
// held it, and its hash in the cache ("" while none is).
type servedCert struct {
	pem  []byte
	hash string
}

// load serves name's certificate as the store holds it, in place of prev,
// and returns what it serves.
func (t *serverTLS) load(ctx context.Context, name string, prev servedCert) (servedCert, error) {
	issuer := t.issuer.IssuerKey()
	certPEM, err := t.storage.Load(ctx, certmagic.StorageKeys.SiteCert(issuer, name))
	if err != nil || bytes.Equal(certPEM, prev.pem) {
		return prev, err
	}
	keyPEM, err := t.storage.Load(ctx, certmagic.StorageKeys.SitePrivateKey(issuer, name))
	if err != nil {
		return prev, err
	}
	hash, err := t.magic.CacheUnmanagedCertificatePEMBytes(ctx, certPEM, keyPEM, nil)
	if err != nil {
		return prev, err
	}
	if prev.hash != "" && prev.hash != hash {
		t.cache.Remove([]string{prev.hash})
	}
	t.log.Info("certificate served from the store", "name", name)
	return servedCert{pem: certPEM, hash: hash}, nil
}

// atoi is a port's number (0 when it is none).
func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}

// stop ends certmagic's maintenance.
func (t *serverTLS) stop() {
	if t.cache != nil {
		t.cache.Stop()
	}
}

// plainHandler serves the plain HTTP listener: ACME's HTTP-01 challenges
// (through the issuer, whichever node set them), and the redirect to HTTPS
// on httpsPort for everything else (RedirectToHTTPS).
func (t *serverTLS) plainHandler(httpsPort string) http.Handler {
	redirect := RedirectToHTTPS(httpsPort, t.serves)
	if t.issuer == nil {
		return redirect
	}
	return t.issuer.HTTPChallengeHandler(redirect)
}

// serves reports whether host is a name the certificate is for.
func (t *serverTLS) serves(host string) bool {
	for _, c := range t.Certificates() {
		if slices.ContainsFunc(c.Names, func(n string) bool { return certmagic.MatchWildcard(host, n) }) {
			return true
		}
	}
	return t.cfg.ACME() && slices.Contains(t.cfg.ACMEDomains, host)
}

// Certificates are the certificates served, each with its names and when
// it expires.
func (t *serverTLS) Certificates() []CertificateView {
	var leaves []*x509.Certificate
	if pair := t.pair.Load(); t.cache == nil && pair != nil && pair.Leaf != nil {
		leaves = append(leaves, pair.Leaf)
	}
	for _, d := range t.cfg.ACMEDomains { // none with files: no cache to ask
		for _, c := range t.cache.AllMatchingCertificates(d) {
			if c.Leaf != nil && !slices.ContainsFunc(leaves, c.Leaf.Equal) {
				leaves = append(leaves, c.Leaf)
			}
		}
	}
	views := make([]CertificateView, 0, len(leaves))
	for _, l := range leaves {
		views = append(views, CertificateView{Names: l.DNSNames, Issuer: l.Issuer.CommonName, NotBefore: l.NotBefore, NotAfter: l.NotAfter,
			ACME: t.cache != nil})
	}
	return views
}

// lives are, by name, the life of the certificate served for it that
// expires last.
func (t *serverTLS) lives() map[string]CertificateView {
	out := map[string]CertificateView{}
	for _, c := range t.Certificates() {
		for _, n := range c.Names {
			if v, ok := out[n]; !ok || c.NotAfter.After(v.NotAfter) {
				out[n] = c
			}
		}
	}
	return out
}

// expiries are the certificates' expiry times by name, for
// switchyard_tls_certificate_expiry_timestamp_seconds.
func (t *serverTLS) expiries() map[string]float64 {
	out := map[string]float64{}
	for n, c := range t.lives() {
		out[n] = float64(c.NotAfter.Unix())
	}
	return out
}

// issued are the certificates' issue times (not before) by name, for
// switchyard_tls_certificate_issued_timestamp_seconds: with the expiry,
// the certificate's life, which the alert rule reads a renewal against.
func (t *serverTLS) issued() map[string]float64 {
	out := map[string]float64{}
	for n, c := range t.lives() {
		out[n] = float64(c.NotBefore.Unix())
	}
	return out
}
