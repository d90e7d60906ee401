// HTTPS served by the daemon itself (server.tls): a certificate obtained
// and renewed by ACME through certmagic, kept in the store, or the
// operator's files, read again on SIGHUP.

package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// serverTLS is how the endpoint serves HTTPS: the listener's tls.Config,
// with the certificate by ACME (magic) or from files (pair).
type serverTLS struct {
	cfg    TLSConfig
	config *tls.Config
	log    *slog.Logger
	// ACME: the cache of certificates certmagic keeps up to date, their
	// config, and the issuer start makes once the listeners are known.
	cache  *certmagic.Cache
	magic  *certmagic.Config
	issuer *certmagic.ACMEIssuer
	// Files: the pair last read.
	pair atomic.Pointer[tls.Certificate]
}

// renewCheckEvery is how often certmagic looks for certificates to renew
// (certmagic.DefaultRenewCheckInterval), server.tls.renew_check when set.
const renewCheckEvery = 10 * time.Minute

// newServerTLS prepares HTTPS as cfg says: the files read, or certmagic's
// config over the store. Nothing is ordered until start.
func newServerTLS(cfg TLSConfig, store *Store, node string, log *slog.Logger) (*serverTLS, error) {
	t := &serverTLS{cfg: cfg, log: log.With("component", "tls")}
	if !cfg.ACME() {
		if err := t.Reload(); err != nil {
			return nil, err
		}
		t.config = &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"},
			GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return t.pair.Load(), nil }}
		return t, nil
	}
	logger := zap.New(slogCore{log: t.log})
	every := cfg.RenewCheck
	if every <= 0 {
		every = renewCheckEvery
	}
	t.cache = certmagic.NewCache(certmagic.CacheOptions{
		GetConfigForCert:   func(certmagic.Certificate) (*certmagic.Config, error) { return t.magic, nil },
		RenewCheckInterval: every, Logger: logger})
	t.magic = certmagic.New(t.cache, certmagic.Config{Storage: newCertStorage(store, node), Logger: logger})
	t.config = t.magic.TLSConfig()
	t.config.MinVersion = tls.VersionTLS12
	if !slices.Contains(t.config.NextProtos, "h2") {
		t.config.NextProtos = append([]string{"h2"}, t.config.NextProtos...)
	}
	return t, nil
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
// start after.
func (t *serverTLS) prepare(api, plain string) error {
	if !t.cfg.ACME() {
		return nil
	}
	template := certmagic.ACMEIssuer{CA: t.cfg.ACMECA, Email: t.cfg.ACMEEmail, Agreed: true, Logger: t.magic.Logger,
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
	t.issuer = certmagic.NewACMEIssuer(t.magic, template)
	t.magic.Issuers = []certmagic.Issuer{t.issuer}
	return nil
}

// start has certmagic obtain and renew the certificate of acme_domains
// with the issuer prepare made. It returns at once; until a certificate is
// obtained, a handshake fails.
func (t *serverTLS) start(ctx context.Context) error {
	if t.issuer == nil {
		return nil
	}
	return t.magic.ManageAsync(ctx, t.cfg.ACMEDomains)
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

// plainHandler serves the plain HTTP listener: ACME's HTTP-01 challenges,
// and a permanent redirect to HTTPS on httpsPort for everything else, to
// a name the certificate is for (the request's Host when it is one).
func (t *serverTLS) plainHandler(httpsPort string) http.Handler {
	redirect := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, err := net.SplitHostPort(r.Host)
		if err != nil {
			host = r.Host
		}
		if !t.serves(host) {
			writeError(w, r, nil, errorf(CodeNotFound, "this server answers for its certificate's names only"))
			return
		}
		if httpsPort != "443" {
			host = net.JoinHostPort(host, httpsPort)
		}
		http.Redirect(w, r, "https://"+host+r.URL.RequestURI(), http.StatusPermanentRedirect)
	})
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

// certStorage is certmagic's storage in the store (store_tls.go): the
// ACME account, the certificates and their keys as tls_files, and its
// locks as tls_locks, so that of the nodes sharing a database one orders
// a certificate and every one serves it.
type certStorage struct {
	store *Store
	node  string
	mu    sync.Mutex
	held  map[string]chan struct{} // the locks this process holds: closed at Unlock
}

// certLockTTL is how long a lock lasts unrenewed (a node that died
// holding it); its holder renews it every third of it.
const certLockTTL = 30 * time.Second

func newCertStorage(store *Store, node string) *certStorage {
	return &certStorage{store: store, node: node, held: map[string]chan struct{}{}}
}

func (c *certStorage) Store(ctx context.Context, key string, value []byte) error {
	return c.store.WriteTx(ctx, func(tx *Tx) error { return tx.StoreTLSFile(ctx, key, value, time.Now()) })
}

func (c *certStorage) Load(ctx context.Context, key string) ([]byte, error) {
	f, err := c.store.LoadTLSFile(ctx, key)
	if errors.Is(err, ErrNoTLSFile) {
		return nil, fmt.Errorf("%w: %w", fs.ErrNotExist, err)
	}
	return f.Value, err
}

func (c *certStorage) Delete(ctx context.Context, key string) error {
	return c.store.WriteTx(ctx, func(tx *Tx) error { return tx.DeleteTLSFiles(ctx, key) })
}

func (c *certStorage) Exists(ctx context.Context, key string) bool {
	_, err := c.Stat(ctx, key)
	return err == nil
}

func (c *certStorage) List(ctx context.Context, path string, recursive bool) ([]string, error) {
	keys, err := c.store.TLSKeys(ctx, path, recursive)
	if err == nil && len(keys) == 0 {
		return nil, fmt.Errorf("%w: nothing under %s", fs.ErrNotExist, path)
	}
	return keys, err
}

func (c *certStorage) Stat(ctx context.Context, key string) (certmagic.KeyInfo, error) {
	f, err := c.store.LoadTLSFile(ctx, key)
	if err == nil {
		return certmagic.KeyInfo{Key: key, Modified: f.Modified, Size: int64(len(f.Value)), IsTerminal: true}, nil
	}
	if !errors.Is(err, ErrNoTLSFile) {
		return certmagic.KeyInfo{}, err
	}
	if keys, err := c.store.TLSKeys(ctx, key, false); err != nil || len(keys) > 0 {
		return certmagic.KeyInfo{Key: key}, err
	}
	return certmagic.KeyInfo{}, fmt.Errorf("%w: %s", fs.ErrNotExist, key)
}

// Lock takes name's lock for this node, waiting while another node, or
// another goroutine of this process, holds it; it renews it until
// Unlock.
func (c *certStorage) Lock(ctx context.Context, name string) error {
	done := make(chan struct{})
	for {
		c.mu.Lock()
		other, busy := c.held[name]
		if !busy {
			c.held[name] = done
		}
		c.mu.Unlock()
		if !busy {
			break
		}
		select {
		case <-other:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	for {
		taken, err := c.take(ctx, name)
		if taken {
			go c.renew(name, done)
			return nil
		}
		wait := time.Second
		if err != nil {
			wait = 5 * time.Second
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			c.forget(name)
			return ctx.Err()
		}
	}
}

// take tries to take name's lock once.
func (c *certStorage) take(ctx context.Context, name string) (held bool, err error) {
	err = c.store.WriteTx(ctx, func(tx *Tx) error {
		held, err = tx.TakeTLSLock(ctx, name, c.node, certLockTTL)
		return err
	})
	return held, err
}

// renew renews name's lock every third of its time until done closes.
func (c *certStorage) renew(name string, done <-chan struct{}) {
	t := time.NewTicker(certLockTTL / 3)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
			ctx, cancel := context.WithTimeout(context.Background(), certLockTTL/3)
			_, _ = c.take(ctx, name)
			cancel()
		}
	}
}

// forget ends this process's hold on name.
func (c *certStorage) forget(name string) {
	c.mu.Lock()
	if done, ok := c.held[name]; ok {
		close(done)
		delete(c.held, name)
	}
	c.mu.Unlock()
}

func (c *certStorage) Unlock(ctx context.Context, name string) error {
	defer c.forget(name)
	ctx = context.WithoutCancel(ctx)
	return c.store.WriteTx(ctx, func(tx *Tx) error { return tx.ReleaseTLSLock(ctx, name, c.node) })
}

// slogCore hands certmagic's log entries (zap) to the daemon's log.
type slogCore struct {
	log    *slog.Logger
	fields []zapcore.Field
}

func (c slogCore) Enabled(l zapcore.Level) bool { return l >= zapcore.InfoLevel }

func (c slogCore) With(fields []zapcore.Field) zapcore.Core {
	return slogCore{log: c.log, fields: append(slices.Clip(c.fields), fields...)}
}

func (c slogCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

func (c slogCore) Write(e zapcore.Entry, fields []zapcore.Field) error {
	enc := zapcore.NewMapObjectEncoder()
	for _, f := range append(slices.Clip(c.fields), fields...) {
		f.AddTo(enc)
	}
	args := make([]any, 0, 2*len(enc.Fields))
	for _, k := range slices.Sorted(maps.Keys(enc.Fields)) {
		args = append(args, k, enc.Fields[k])
	}
	level := slog.LevelInfo
	switch {
	case e.Level >= zapcore.ErrorLevel:
		level = slog.LevelError
	case e.Level == zapcore.WarnLevel:
		level = slog.LevelWarn
	}
	c.log.Log(context.Background(), level, e.Message, args...)
	return nil
}

func (c slogCore) Sync() error { return nil }
