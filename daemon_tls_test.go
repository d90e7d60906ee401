package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// testDomain is the name the tests' certificates are for: Pebble's
// challenge test server answers 127.0.0.1 for it.
const testDomain = "hooks.switchyard.test"

// pebbleTool is .tools/<name>, Pebble's programs (PEBBLE_DIR's when set),
// built by make from tools/pebble when missing.
func pebbleTool(t testing.TB, name string) string {
	t.Helper()
	dir := os.Getenv("PEBBLE_DIR")
	if dir == "" {
		dir, _ = filepath.Abs(".tools")
	}
	p := filepath.Join(dir, name)
	if _, err := os.Stat(p); err != nil {
		makeTool(t, ".tools/"+name)
	}
	return p
}

// testACME is an ACME server of the test's own: Pebble, validating
// TLS-ALPN-01 and HTTP-01 at the ports it was given on whatever its
// challenge test server answers for a name (127.0.0.1).
type testACME struct {
	directory string         // the ACME directory's URL
	caRoot    string         // PEM: the root of Pebble's own HTTPS (acme_ca_root)
	roots     *x509.CertPool // what the certificates it issues chain to
	rootPEM   []byte         // the same, PEM (SSL_CERT_FILE for a command)
	out       *syncBuffer
}

// startPebble starts Pebble, its certificates valid for validity, its
// challenges validated at tlsPort and httpPort.
func startPebble(t *testing.T, tlsPort, httpPort string, validity time.Duration) *testACME {
	t.Helper()
	dir := t.TempDir()
	der, key, caRoot := localCert(t)
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	for f, b := range map[string]*pem.Block{certFile: {Type: "CERTIFICATE", Bytes: der}, keyFile: {Type: "EC PRIVATE KEY", Bytes: keyDER}} {
		if err := os.WriteFile(f, pem.EncodeToMemory(b), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	dns := freeAddr(t)
	started(t, exec.Command(pebbleTool(t, "pebble-challtestsrv"), "-defaultIPv4", "127.0.0.1", "-defaultIPv6", "",
		"-dnsserver", dns, "-http01", "", "-https01", "", "-tlsalpn01", "", "-doh", "", "-management", freeAddr(t)))
	// Pebble resolves the name at this server (over TCP) when it validates;
	// a challenge it validates before the server is up fails as malformed,
	// which certmagic tries again only a minute later.
	resolver := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "tcp", dns)
	}}
	eventually(t, 20*time.Second, "the challenge server's DNS", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := resolver.LookupHost(ctx, testDomain)
		return err == nil
	})
	api, mgmt := freeAddr(t), freeAddr(t)
	config, _ := json.Marshal(map[string]any{"pebble": map[string]any{
		"listenAddress": api, "managementListenAddress": mgmt, "certificate": certFile, "privateKey": keyFile,
		"httpPort": atoi(httpPort), "tlsPort": atoi(tlsPort), "ocspResponderURL": "", "externalAccountBindingRequired": false,
		"retryAfter": map[string]int{"authz": 1, "order": 1}, "keyAlgorithm": "ecdsa",
		"profiles": map[string]any{"default": map[string]any{"description": "short-lived", "validityPeriod": int(validity.Seconds())}},
	}})
	configFile := filepath.Join(dir, "pebble.json")
	if err := os.WriteFile(configFile, config, 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(pebbleTool(t, "pebble"), "-config", configFile, "-dnsserver", dns, "-strict=false")
	cmd.Env = append(os.Environ(), "PEBBLE_VA_NOSLEEP=1", "PEBBLE_WFE_NONCEREJECT=0")
	a := &testACME{directory: "https://" + api + "/dir", caRoot: caRoot, roots: x509.NewCertPool(), out: started(t, cmd)}
	pebbleCA := x509.NewCertPool()
	pebbleCA.AppendCertsFromPEM(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pebbleCA}}}
	var root []byte
	eventually(t, 20*time.Second, "Pebble's root", func() bool {
		resp, err := client.Get("https://" + mgmt + "/roots/0")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		root, _ = io.ReadAll(resp.Body)
		return resp.StatusCode == http.StatusOK
	})
	if !a.roots.AppendCertsFromPEM(root) {
		t.Fatalf("Pebble's root is no PEM:\n%s", root)
	}
	a.rootPEM = root
	return a
}

// tlsConfigKeys are [server.tls]'s keys for a certificate of testDomain
// from a, with the plain listener at plain, renewals looked for every
// second.
func (a *testACME) tlsConfigKeys(plain string) string {
	return fmt.Sprintf("[server.tls]\nacme_domains = [%q]\nacme_email = \"ops@switchyard.test\"\nacme_ca = %q\nacme_ca_root = %q\nhttp_listen = %q\nrenew_check = \"1s\"\n",
		testDomain, a.directory, a.caRoot, plain)
}

// httpsClient is a client that trusts only roots, dials testDomain at
// addr, and makes a new connection (a new handshake) for each request.
func httpsClient(roots *x509.CertPool, addr string) *http.Client {
	dialer := &net.Dialer{Timeout: 5 * time.Second}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		TLSClientConfig:   &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		DisableKeepAlives: true, ForceAttemptHTTP2: true,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, network, addr)
		},
	}}
}

// servedSerial is the serial of the certificate addr serves for
// testDomain, checked against roots; "" while it serves none.
func servedSerial(roots *x509.CertPool, addr string) string {
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, &tls.Config{ServerName: testDomain, RootCAs: roots})
	if err != nil {
		return ""
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0].SerialNumber.String()
}

// One binary faces the internet: serve obtains its certificate from an
// ACME server (Pebble, TLS-ALPN-01 on its HTTPS listener), takes a signed
// webhook over HTTPS and HTTP/2 checked against the ACME server's root,
// stores it once, redirects plain HTTP, keeps the certificate in its
// database, and renews a short-lived certificate under a steady stream of
// webhooks, each on a new connection, refusing none.
func TestHTTPSByACME(t *testing.T) {
	t.Parallel()
	addr, plain := freeAddr(t), freeAddr(t)
	_, tlsPort, _ := net.SplitHostPort(addr)
	_, httpPort, _ := net.SplitHostPort(plain)
	acme := startPebble(t, tlsPort, httpPort, 30*time.Second)
	dir := t.TempDir()
	dbPath := filepath.Join(dir, "switchyard.db")
	config := writeConfigWith(t, dir, addr, fmt.Sprintf("path = %q", dbPath), acme.tlsConfigKeys(plain), amqpURL(newVhost(t)))
	cmd := exec.Command(builtBinary(t), "serve", "-config", config)
	out := started(t, cmd)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("serve:\n%s\npebble:\n%s", out, acme.out)
		}
	})
	eventually(t, 60*time.Second, "a certificate from the ACME server served", func() bool {
		return servedSerial(acme.roots, addr) != ""
	})
	client := httpsClient(acme.roots, addr)
	base := "https://" + testDomain + ":" + tlsPort
	body := loadFixture(t, "issues", "opened")

	// A steady stream from the first certificate on, each webhook a new
	// handshake: the renewal comes while it runs, and refuses none.
	var mu sync.Mutex
	var answers, refused int
	sent := func() int {
		mu.Lock()
		defer mu.Unlock()
		return answers
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			resp, err := client.Do(webhookRequest(t, base, "issues", newGUID(), body))
			mu.Lock()
			answers++
			if err != nil || resp.StatusCode != http.StatusAccepted {
				refused++
				t.Logf("a webhook during the renewal: %v %v", err, resp)
			}
			mu.Unlock()
			if err == nil {
				resp.Body.Close()
			}
			time.Sleep(50 * time.Millisecond) // a steady stream, about 20 a second
		}
	})
	defer func() { close(stop); wg.Wait() }()

	guid := newGUID()
	resp, err := client.Do(webhookRequest(t, base, "issues", guid, body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted || resp.ProtoMajor != 2 || resp.TLS.Version < tls.VersionTLS12 {
		t.Fatalf("a webhook over HTTPS: %d over %s, TLS %x; want 202 over HTTP/2, TLS 1.2 or later", resp.StatusCode, resp.Proto, resp.TLS.Version)
	}
	db := openDB(t, dbPath)
	eventually(t, 20*time.Second, "the webhook stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid) == 1
	})
	if n := queryInt(t, db, "SELECT count(*) FROM tls_files WHERE key LIKE 'certificates/%'"); n == 0 {
		t.Error("the database file holds no certificate")
	}
	redirectsToHTTPS(t, plain, tlsPort)

	// Renewed (ARI picks a moment of its life) while webhooks flow.
	eventually(t, 20*time.Second, "the stream under way", func() bool { return sent() > 0 })
	before := servedSerial(acme.roots, addr)
	eventually(t, 90*time.Second, "the certificate renewed", func() bool {
		s := servedSerial(acme.roots, addr)
		return s != "" && s != before
	})
	renewedAt := sent()
	eventually(t, 30*time.Second, "webhooks on the renewed certificate", func() bool { return sent() >= renewedAt+20 })
	mu.Lock()
	if refused > 0 {
		t.Errorf("%d of %d webhooks refused while the certificate was renewed", refused, answers)
	}
	t.Logf("certificate %s renewed under a stream of %d webhooks (%d before the renewal), none refused", before, answers, renewedAt)
	mu.Unlock()
	metrics := scrapeWith(client, base+"/metrics", "switchyard_tls_certificate_expiry_timestamp_seconds")
	if metrics[testDomain] < float64(time.Now().Unix()) {
		t.Errorf("switchyard_tls_certificate_expiry_timestamp_seconds = %v, want the renewed certificate's expiry for %s", metrics, testDomain)
	}
	stopProcess(t, cmd, out, 30*time.Second)
}

// With port 443 out of the CA's reach (a port forward, a VPS's firewall),
// only HTTP-01 on the plain listener can prove the name: Pebble validates
// TLS-ALPN-01 at a port nothing listens on. serve obtains its certificate
// all the same; `switchyard status` reads the HTTPS daemon (trusting the
// CA through SSL_CERT_FILE, as an operator with a private CA does) and
// calls a fresh short-lived certificate well, not one about to expire;
// HEAD /healthz answers 200 over HTTPS, as the README's curl -sI asks.
func TestHTTP01Alone(t *testing.T) {
	t.Parallel()
	addr, plain := freeAddr(t), freeAddr(t)
	_, tlsPort, _ := net.SplitHostPort(addr)
	_, httpPort, _ := net.SplitHostPort(plain)
	_, closedPort, _ := net.SplitHostPort(freeAddr(t))
	acme := startPebble(t, closedPort, httpPort, 6*24*time.Hour)
	dir := t.TempDir()
	config := writeConfigWith(t, dir, addr, fmt.Sprintf("path = %q", filepath.Join(dir, "switchyard.db")),
		acme.tlsConfigKeys(plain), amqpURL(newVhost(t)))
	cmd := exec.Command(builtBinary(t), "serve", "-config", config)
	out := started(t, cmd)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("serve:\n%s\npebble:\n%s", out, acme.out)
		}
	})
	eventually(t, 60*time.Second, "a certificate by HTTP-01", func() bool { return servedSerial(acme.roots, addr) != "" })

	client := httpsClient(acme.roots, addr)
	req, _ := http.NewRequest(http.MethodHead, "https://"+testDomain+":"+tlsPort+"/healthz", nil)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("HEAD /healthz over HTTPS: %d, want 200", resp.StatusCode)
	}

	roots := filepath.Join(dir, "roots.pem")
	if err := os.WriteFile(roots, acme.rootPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	status := exec.Command(builtBinary(t), "status", "-config", config)
	status.Env = append(os.Environ(), "SSL_CERT_FILE="+roots)
	text, err := status.CombinedOutput()
	if err != nil || !strings.Contains(string(text), "certificate: "+testDomain) || strings.Contains(string(text), "not been renewed") {
		t.Errorf("switchyard status of the HTTPS daemon: %v\n%s\nwant exit 0 showing the fresh certificate of %s", err, text, testDomain)
	}
	stopProcess(t, cmd, out, 30*time.Second)
}

// redirectsToHTTPS holds the plain listener at plain to a permanent
// redirect to HTTPS on tlsPort for the certificate's name, and to
// refusing a name it is not for.
func redirectsToHTTPS(t *testing.T, plain, tlsPort string) {
	t.Helper()
	noFollow := &http.Client{Timeout: 5 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	for host, want := range map[string]string{testDomain: "https://" + testDomain + ":" + tlsPort + "/status?x=1", "evil.example": ""} {
		req, _ := http.NewRequest(http.MethodGet, "http://"+plain+"/status?x=1", nil)
		req.Host = host
		resp, err := noFollow.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		switch loc := resp.Header.Get("Location"); {
		case want != "" && (resp.StatusCode != http.StatusPermanentRedirect || loc != want):
			t.Errorf("plain HTTP for %s: %d to %q, want 308 to %q", host, resp.StatusCode, loc, want)
		case want == "" && (resp.StatusCode < 400 || loc != ""):
			t.Errorf("plain HTTP for %s: %d to %q, want a 4xx", host, resp.StatusCode, loc)
		}
	}
}

// Two nodes on one PostgreSQL database serve the one certificate, ordered
// once: whichever node takes the lock orders it; the other finds it in the
// store (and Pebble, validating at node 1, gets its answer from whichever
// node set the challenge, through the store).
func TestTwoNodesServeOneCertificate(t *testing.T) {
	t.Parallel()
	dbURL := newPostgresDatabase(t)
	vhost := newVhost(t)
	addrs := []string{freeAddr(t), freeAddr(t)}
	plains := []string{freeAddr(t), freeAddr(t)}
	_, tlsPort, _ := net.SplitHostPort(addrs[0])
	_, httpPort, _ := net.SplitHostPort(plains[0])
	acme := startPebble(t, tlsPort, httpPort, time.Hour)
	var outs []*syncBuffer
	for i := range addrs {
		dir := t.TempDir()
		database := fmt.Sprintf("driver = \"postgres\"\nurl = %q", dbURL)
		server := fmt.Sprintf("node_name = \"node-%d\"\nlease_ttl = \"3s\"\n", i+1) + acme.tlsConfigKeys(plains[i])
		config := writeConfigWith(t, dir, addrs[i], database, server, amqpURL(vhost))
		outs = append(outs, started(t, exec.Command(builtBinary(t), "serve", "-config", config)))
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("node 1:\n%s\nnode 2:\n%s\npebble:\n%s", outs[0], outs[1], acme.out)
		}
	})
	serials := make([]string, len(addrs))
	for i, addr := range addrs {
		eventually(t, 90*time.Second, fmt.Sprintf("node %d serving a certificate", i+1), func() bool {
			serials[i] = servedSerial(acme.roots, addr)
			return serials[i] != ""
		})
	}
	if serials[0] != serials[1] {
		t.Errorf("the nodes serve certificates %s and %s, want the one", serials[0], serials[1])
	}
	obtained := strings.Count(outs[0].String(), "certificate obtained successfully") + strings.Count(outs[1].String(), "certificate obtained successfully")
	if obtained != 1 {
		t.Errorf("the certificate was obtained %d times, want once", obtained)
	}
	for i, addr := range addrs {
		_, port, _ := net.SplitHostPort(addr)
		guid := newGUID()
		resp, err := httpsClient(acme.roots, addr).Do(webhookRequest(t, "https://"+testDomain+":"+port, "issues", guid, loadFixture(t, "issues", "opened")))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusAccepted {
			t.Errorf("a webhook over HTTPS to node %d: %d", i+1, resp.StatusCode)
		}
	}
}

// check-config refuses a [server.tls] that cannot work, every problem at
// once: ACME and files both, a key anyone may read, a CA that is no
// https URL, a name ACME cannot issue for; and a plain listener with no
// domain, a key file that is not there; and a wildcard, which only DNS-01
// (which switchyard does not answer) can issue for.
func TestTLSConfigRefused(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cert, key := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	os.WriteFile(cert, []byte("-"), 0o644)
	os.WriteFile(key, []byte("-"), 0o644)
	for _, c := range []struct {
		keys string
		want []string
	}{
		{fmt.Sprintf("acme_domains = [\"hooks.example.com\", \"10.0.0.1\"]\nacme_ca = \"http://ca.example\"\ncert_file = %q\nkey_file = %q\n", cert, key),
			[]string{"server.tls.acme_domains: and cert_file/key_file both given", "server.tls.acme_domains[1]", "server.tls.acme_ca",
				"server.tls.key_file: " + key + " is readable by everyone"}},
		{fmt.Sprintf("http_listen = \":80\"\nkey_file = %q\n", filepath.Join(dir, "none.pem")),
			[]string{"server.tls.cert_file: and key_file go together", "server.tls.key_file: stat " + filepath.Join(dir, "none.pem")}},
		{"http_listen = \":80\"\n", []string{"server.tls.acme_domains: no domain"}},
		{"acme_domains = [\"*.hooks.example.com\"]\n", []string{"server.tls.acme_domains[0]: \"*.hooks.example.com\" is a wildcard, which ACME issues only by DNS-01"}},
	} {
		config := writeConfigWith(t, t.TempDir(), "127.0.0.1:8080", "path = \"sy.db\"", "[server.tls]\n"+c.keys, amqpURL("unused"))
		var out bytes.Buffer
		err := run(context.Background(), []string{"check-config", "-config", config}, &out, &out)
		if err == nil {
			t.Errorf("check-config of\n%s: no error", c.keys)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("check-config of\n%s: lacks %q:\n%v", c.keys, w, err)
			}
		}
	}
}

// selfSignedFor writes a certificate for name, self-signed, serial its
// serial, and its key (mode 0600) to dir; it returns their paths and a pool
// that trusts it.
func selfSignedFor(t *testing.T, dir, name string, serial int64) (cert, key string, roots *x509.CertPool) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(90 * 24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalECPrivateKey(k)
	cert, key = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	os.WriteFile(cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	os.WriteFile(key, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600)
	roots = x509.NewCertPool()
	roots.AppendCertsFromPEM(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	return cert, key, roots
}

// As systemd passes switchyard-https.socket and switchyard-http.socket
// (LISTEN_FDS=2, named https and http): serve takes a webhook over HTTPS
// with the certificate of server.tls.cert_file on the one, redirects on
// the other, shows the certificate's expiry in its status, and serves the
// files' new certificate after a SIGHUP.
func TestHTTPSOnPassedSockets(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cert, key, roots := selfSignedFor(t, dir, testDomain, 1)
	var files []*os.File
	var addrs []string
	for range 2 {
		ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatal(err)
		}
		f, _ := ln.File()
		ln.Close()
		defer f.Close()
		files, addrs = append(files, f), append(addrs, ln.Addr().String())
	}
	_, tlsPort, _ := net.SplitHostPort(addrs[0])
	dbPath := filepath.Join(dir, "switchyard.db")
	config := writeConfigWith(t, dir, addrs[0], fmt.Sprintf("path = %q", dbPath),
		fmt.Sprintf("[server.tls]\ncert_file = %q\nkey_file = %q\nhttp_listen = %q\n", cert, key, addrs[1]), amqpURL(newVhost(t)))
	cmd := exec.Command("/bin/sh", "-c", `LISTEN_PID=$$ LISTEN_FDS=2 LISTEN_FDNAMES=https:http exec "$0" serve -config "$1"`, builtBinary(t), config)
	cmd.ExtraFiles = files
	out := started(t, cmd)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("serve:\n%s", out)
		}
	})
	eventually(t, 20*time.Second, "HTTPS on the passed socket", func() bool { return servedSerial(roots, addrs[0]) == "1" })
	client := httpsClient(roots, addrs[0])
	base := "https://" + testDomain + ":" + tlsPort
	guid := newGUID()
	resp, err := client.Do(webhookRequest(t, base, "issues", guid, loadFixture(t, "issues", "opened")))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted || resp.ProtoMajor != 2 {
		t.Fatalf("a webhook over HTTPS: %d over %s, want 202 over HTTP/2", resp.StatusCode, resp.Proto)
	}
	eventually(t, 20*time.Second, "the webhook stored", func() bool {
		return queryInt(t, openDB(t, dbPath), "SELECT count(*) FROM github WHERE delivery_id = $1", guid) == 1
	})
	redirectsToHTTPS(t, addrs[1], tlsPort)
	if !strings.Contains(out.String(), `"name":"https"`) && !strings.Contains(out.String(), "name=https") {
		t.Errorf("serve does not say it serves the socket named https:\n%s", out)
	}

	req, _ := http.NewRequest(http.MethodGet, base+"/api/v1/status", nil)
	req.Header.Set("Authorization", "Bearer operator-token-for-tests")
	resp, err = client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var st Status
	err = json.NewDecoder(resp.Body).Decode(&st)
	resp.Body.Close()
	if err != nil || len(st.Certificates) != 1 || st.Certificates[0].NotAfter.Before(time.Now().Add(89*24*time.Hour)) ||
		st.Certificates[0].Names[0] != testDomain {
		t.Errorf("the status's certificates: %+v (%v), want the one for %s, 90 days", st.Certificates, err, testDomain)
	}

	// switchyard status reads the HTTPS daemon, trusting cert_file's own
	// certificate (self-signed here), as an operator runs it.
	if text, code := runBinary(t, "status", "-config", config); code == exitUnreachable || !strings.Contains(text, "certificate: "+testDomain) {
		t.Errorf("switchyard status of the HTTPS daemon with cert_file: exit %d\n%s\nwant the certificate of %s", code, text, testDomain)
	}

	// New files, then SIGHUP: the new certificate is served.
	_, _, renewed := selfSignedFor(t, dir, testDomain, 2)
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "the new certificate served after SIGHUP", func() bool { return servedSerial(renewed, addrs[0]) == "2" })
	stopProcess(t, cmd, out, 30*time.Second)
}

// Ordering and renewing the certificate is the job of the node holding
// the acme lease, and no other's: of two nodes on one PostgreSQL database
// (short-lived certificates, renewed every few seconds), only the holder
// orders while both serve what the store holds, and nothing is written to
// the lock table of old. SIGKILLed, the holder's lease passes to the other
// node, which renews from then on and serves its renewal. (Pebble
// validates at proxies that send the challenges to a live node: the
// answers are in the store, whichever node set them.)
func TestACMEUnderTheLease(t *testing.T) {
	t.Parallel()
	dbURL := newPostgresDatabase(t)
	vhost := newVhost(t)
	addrs := []string{freeAddr(t), freeAddr(t)}
	plains := []string{freeAddr(t), freeAddr(t)}
	tlsFront, httpFront := newTCPProxy(t, addrs[0]), newTCPProxy(t, plains[0])
	_, tlsPort, _ := net.SplitHostPort(tlsFront.addr)
	_, httpPort, _ := net.SplitHostPort(httpFront.addr)
	acme := startPebble(t, tlsPort, httpPort, 20*time.Second)
	var cmds []*exec.Cmd
	var outs []*syncBuffer
	for i := range addrs {
		dir := t.TempDir()
		database := fmt.Sprintf("driver = \"postgres\"\nurl = %q", dbURL)
		server := fmt.Sprintf("node_name = \"node-%d\"\nlease_ttl = \"3s\"\n", i) + acme.tlsConfigKeys(plains[i])
		cmds = append(cmds, exec.Command(builtBinary(t), "serve", "-config", writeConfigWith(t, dir, addrs[i], database, server, amqpURL(vhost))))
		outs = append(outs, started(t, cmds[i]))
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("node-0:\n%s\nnode-1:\n%s\npebble:\n%s", outs[0], outs[1], acme.out)
		}
	})
	for i, addr := range addrs {
		eventually(t, 90*time.Second, fmt.Sprintf("node-%d serving a certificate", i), func() bool { return servedSerial(acme.roots, addr) != "" })
	}
	db := openStoreDB(t, DatabaseConfig{Driver: "postgres", URL: dbURL})
	var holder string
	if err := db.QueryRow("SELECT node FROM leases WHERE job = 'acme'").Scan(&holder); err != nil {
		t.Fatalf("the acme lease: %v", err)
	}
	h := map[string]int{"node-0": 0, "node-1": 1}[holder]
	other := 1 - h
	const obtained = "certificate obtained successfully"
	if !strings.Contains(outs[h].String(), obtained) || strings.Contains(outs[other].String(), "obtaining certificate") {
		t.Fatalf("%s holds the acme lease; want it alone to order (holder's orders: %d, the other's: %d)", holder,
			strings.Count(outs[h].String(), obtained), strings.Count(outs[other].String(), "obtaining certificate"))
	}
	if n := queryInt(t, db, "SELECT count(*) FROM tls_locks"); n != 0 {
		t.Errorf("tls_locks holds %d rows, want none: ordering is the lease's", n)
	}

	tlsFront.Retarget(addrs[other])
	httpFront.Retarget(plains[other])
	if err := cmds[h].Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmds[h].Wait()
	before, seen := servedSerial(acme.roots, addrs[other]), len(outs[other].String())
	eventually(t, 30*time.Second, "the survivor holding the acme lease", func() bool {
		var node string
		return db.QueryRow("SELECT node FROM leases WHERE job = 'acme'").Scan(&node) == nil && node == fmt.Sprintf("node-%d", other)
	})
	eventually(t, 90*time.Second, "the survivor renewing and serving its renewal", func() bool {
		s := servedSerial(acme.roots, addrs[other])
		ordered := outs[other].String()[seen:]
		return (strings.Contains(ordered, "certificate renewed successfully") || strings.Contains(ordered, obtained)) && s != "" && s != before
	})
	stopProcess(t, cmds[other], outs[other], 30*time.Second)
}
