# switchyard: see README.md.
# One version for the binary (--version) and the Debian package: the release
# this tree leads to, the commit, and .dirty for uncommitted changes (Debian
# versions start with a digit; "+" sorts builds of one release by nothing
# else, which is fine for packages built from one branch).
RELEASE ?= 0.3.0
VERSION ?= $(RELEASE)+git$(shell git rev-parse --short HEAD 2>/dev/null || echo 0)$(shell git diff --quiet HEAD 2>/dev/null || echo .dirty)
GO      ?= go
CONFIG  ?= config.dev.toml
PREFIX  ?= /usr/local
STATICCHECK_VERSION ?= v0.8.2

SHELL   := /bin/bash
export CGO_ENABLED = 0

BINARY  ?= switchyard
UNITDIR ?= /etc/systemd/system

.PHONY: build run test test-tracing test-pgbouncer lint fuzz bench install deb screenshot clean ensure-rabbitmq ensure-postgres ensure-chromium

# Tools the tests need that Go does not bring, fetched here when missing.
TOOLS    := .tools
PROMTOOL := $(TOOLS)/promtool
HAPROXY  := $(TOOLS)/haproxy
PGBOUNCER := $(TOOLS)/pgbouncer
PEBBLE   := $(TOOLS)/pebble $(TOOLS)/pebble-challtestsrv
JAEGER   := $(TOOLS)/jaeger-1.75.0
# The trace tests need Jaeger, whose cold build takes longer than the rest
# of the suite: test-tracing runs them, and .ci/run calls that after test.
TRACE_TESTS ?= TestOneTracePerDelivery|TestTraceOfLeftoverDrainAndRepublish
# The RabbitMQ cluster of the test's own (three nodes) runs after the rest,
# not beside it: starved of the two cores by the tests around it, a node's
# answers, not switchyard's, made a webhook wait past its client's 10 s.
CLUSTER_TESTS ?= TestOutboxClusterNodesLost
SUDO     := $(if $(filter 0,$(shell id -u)),,sudo)
NFPM     := github.com/goreleaser/nfpm/v2/cmd/nfpm@v2.45.2

build:
	$(GO) build -trimpath -ldflags "-s -w -X main.version=$(VERSION)" -o switchyard .

# The daemon with the development config (CONFIG=PATH for another), a local
# database file and the local RabbitMQ.
run: build ensure-rabbitmq
	./switchyard serve -config $(CONFIG)

# The race-built test binary, vetted as go test vets, and linked once for
# every pass below rather than once each; it runs in this directory, as go
# test runs it.
TESTBIN := switchyard.test

$(TESTBIN): $(wildcard *.go) go.mod go.sum
	$(GO) vet .
	CGO_ENABLED=1 $(GO) test -c -race -o $@ .
	$(GO) build $(TESTBUILDFLAGS) -o /dev/null .

# The tests' own build of the daemon (builtBinary's flags), made above on
# both cores while nothing waits, so that the tests that start it only link.
TESTBUILDFLAGS := -trimpath

# testrun runs the test binary with its arguments through .ci/testrun:
# what a plain run shows, the ten slowest tests, and, when it fails, the
# lines that say what at the end.
TESTFN = testrun() { ./.ci/testrun ./$(TESTBIN) "$$@"; }

# -race needs cgo; the tests build their own binary where they need one.
# The tests run on SQLite and on the local PostgreSQL (each its own
# databases); -parallel 4 keeps both cores busy while tests wait on
# brokers and timers. Then the PostgreSQL half once more through a pooler
# (test-pgbouncer).
test: ensure-rabbitmq ensure-postgres ensure-chromium $(PROMTOOL) $(HAPROXY) $(PGBOUNCER) $(PEBBLE) $(TESTBIN)
	@$(TESTFN); PROMTOOL=$(CURDIR)/$(PROMTOOL) HAPROXY=$(CURDIR)/$(HAPROXY) PGBOUNCER=$(CURDIR)/$(PGBOUNCER) PEBBLE_DIR=$(CURDIR)/$(TOOLS) testrun -test.count=1 -test.parallel 4 -test.timeout 25m -test.skip '^($(TRACE_TESTS)|$(CLUSTER_TESTS))$$'
	@$(TESTFN); HAPROXY=$(CURDIR)/$(HAPROXY) testrun -test.count=1 -test.timeout 10m -test.run '^($(CLUSTER_TESTS))$$'
	$(MAKE) --no-print-directory test-pgbouncer

# The PostgreSQL store and node tests once more, through pgbouncer in
# transaction mode (started here, as the postgres user, on a port of its
# own), with the URL the README gives for a pooler: the postgres half of
# every test that runs on both stores (onBothStores), then the tests of
# several nodes. Each test's own checks hold through it: every webhook
# stored once, no attempt burned, nothing in an -error queue.
# The tests of a broker's faults the pooler pass leaves out: they hold the
# broker, not the store, to account (the outbox's store is there in
# TestOutboxStoreRefuses and TestOutboxSurvivesSIGKILL), and take a minute each.
BROKER_FAULT_TESTS ?= TestOutboxClusterNodesLost|TestOutboxBrokerLinkCut|TestOutboxBrokerRefusesUser|TestOutboxExchangeDeleted
NODE_TESTS ?= TestThreeNodesOneStore|TestOutboxOfDeadNodeForwarded|TestBatchSendsAhead|TestNodeBelowRisingFloor|TestFleetBehindHAProxyRefusesNothing|TestTwoNodesRolledBehindHAProxy
# Alone after them: it pauses a node with SIGSTOP and holds it to taking
# no step once resumed, which the load of five other fleets beside it on
# two cores stretches past its lease_ttl of 2 s.
PAUSE_TESTS ?= TestPausedHolderTakesNoStep
test-pgbouncer: ensure-postgres $(PGBOUNCER) $(HAPROXY) $(TESTBIN)
	@dir=$$(mktemp -d /tmp/switchyard-pgbouncer.XXXXXX); port=$$((20000 + RANDOM % 20000)); \
	printf '[databases]\n* = host=127.0.0.1 port=5432\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = %s\nunix_socket_dir =\nauth_type = trust\nauth_file = %s/users\npool_mode = transaction\nmax_client_conn = 1000\ndefault_pool_size = 40\nignore_startup_parameters = extra_float_digits\nlogfile = %s/pgbouncer.log\n' $$port $$dir $$dir > $$dir/pgbouncer.ini; \
	echo '"postgres" ""' > $$dir/users; cp $(PGBOUNCER) $$dir/pgbouncer; chmod 0755 $$dir; chown -R postgres $$dir; \
	runuser -u postgres -- $$dir/pgbouncer $$dir/pgbouncer.ini >/dev/null 2>&1 & pid=$$!; \
	trap "kill $$pid 2>/dev/null; rm -rf $$dir" EXIT; \
	for i in $$(seq 1 50); do (echo > /dev/tcp/127.0.0.1/$$port) 2>/dev/null && break; sleep 0.1; done; \
	both=$$(awk '/^func /{name=""} /^func Test/{name=$$2; sub(/\(.*/,"",name)} /onBothStores\(t/ && name!="" {print name}' *_test.go | sort -u | paste -sd'|'); \
	export SWITCHYARD_TEST_POSTGRES_URL="postgres://postgres@127.0.0.1:$$port/postgres?sslmode=disable&default_query_exec_mode=exec" \
		HAPROXY=$(CURDIR)/$(HAPROXY); \
	echo "the PostgreSQL tests through pgbouncer (transaction mode) on 127.0.0.1:$$port"; \
	$(TESTFN); testrun -test.count=1 -test.parallel 4 -test.timeout 10m -test.run "^($$both)\$$/^postgres\$$" -test.skip '^($(BROKER_FAULT_TESTS))$$' && \
	testrun -test.count=1 -test.parallel 4 -test.timeout 10m -test.run '^($(NODE_TESTS))$$' && \
	testrun -test.count=1 -test.timeout 10m -test.run '^($(PAUSE_TESTS))$$'

lint:
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...

# A short run of every fuzz target; FUZZTIME=10m for a real one.
FUZZTIME ?= 20s
fuzz:
	for f in FuzzWebhookRequest FuzzPendingSwitchBody FuzzBrokerURL FuzzDecodeEvent FuzzValidJSON FuzzDecodeJSON; do \
		CGO_ENABLED=1 $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) . || exit 1; done

bench: ensure-rabbitmq
	$(GO) test -run '^$$' -bench '^BenchmarkSwitchyard$$' -benchtime 1x -timeout 30m .

# Binary, units (the service and its socket, enabled), example config and
# README, DESTDIR-aware. The live config is
# never overwritten: copy the example to /etc/switchyard/switchyard.toml.
# It installs the binary `make build` made and never runs Go, so that
# `make build && sudo make install` works under sudo's PATH.
install:
	@test -f $(BINARY) || { echo "make install: no $(BINARY) to install; run 'make build' first (as your user)"; exit 1; }
	install -D -m 0755 $(BINARY) $(DESTDIR)$(PREFIX)/bin/switchyard
	install -d -m 0755 $(DESTDIR)$(UNITDIR)
	@# switchyard-https.socket and switchyard-http.socket are installed, not
	@# enabled: they replace switchyard.socket when switchyard serves HTTPS.
	for u in switchyard.service switchyard.socket switchyard-https.socket switchyard-http.socket; do \
		sed 's|/usr/local/bin/switchyard|$(PREFIX)/bin/switchyard|g; s|/usr/local/share/doc|$(PREFIX)/share/doc|g' deploy/$$u > $(DESTDIR)$(UNITDIR)/$$u && \
		chmod 0644 $(DESTDIR)$(UNITDIR)/$$u || exit 1; done
	@# Enabled, not started: the config needs its secrets first. Enabling is
	@# links under UNITDIR, made offline (--root) and so under DESTDIR too.
	@if command -v systemctl >/dev/null 2>&1; then \
		systemctl --quiet --root=$(if $(DESTDIR),$(DESTDIR),/) enable switchyard.socket switchyard.service 2>/dev/null || \
		echo "make install: enable them: systemctl enable switchyard.socket switchyard.service"; \
		if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi; fi
	install -D -m 0640 config.example.toml $(DESTDIR)/etc/switchyard/switchyard.toml.example
	install -D -m 0644 README.md $(DESTDIR)$(PREFIX)/share/doc/switchyard/README.md
	install -d -m 0755 $(DESTDIR)$(PREFIX)/share/doc/switchyard/docs
	install -m 0644 docs/*.md docs/*.png $(DESTDIR)$(PREFIX)/share/doc/switchyard/docs/
	install -D -m 0644 deploy/switchyard-https.conf $(DESTDIR)$(PREFIX)/share/switchyard/switchyard-https.conf

# The Debian package: binary, unit, config (a conffile), rules and README;
# postinst creates the switchyard user and /var/lib/switchyard.
deb: build
	rm -rf dist/deb && mkdir -p dist/deb
	cp switchyard dist/deb/switchyard
	{ echo "# switchyard under systemd, from the Debian package (its postinst created the user)."; \
	  sed '/^# switchyard under systemd/,/^\[Unit\]/{/^#/d}; s|/usr/local/bin/switchyard|/usr/bin/switchyard|g; s|/usr/local/share/doc|/usr/share/doc|g' deploy/switchyard.service; \
	} > dist/deb/switchyard.service
	for u in switchyard.socket switchyard-https.socket switchyard-http.socket; do \
		sed 's|/usr/local/share/doc|/usr/share/doc|g' deploy/$$u > dist/deb/$$u || exit 1; done
	SWITCHYARD_DEB_VERSION=$(VERSION) $(GO) run $(NFPM) package -f deploy/nfpm.yaml -p deb -t dist/
	@ls dist/*.deb

# docs/status.png and docs/deliveries.png, the README's pictures: the status
# page (two brokers, a pending switch, a message in an -error queue) and a
# delivery's page after its replay from -error, in headless Chromium.
screenshot: ensure-rabbitmq ensure-chromium
	SWITCHYARD_SCREENSHOT=$(CURDIR)/docs/status.png SWITCHYARD_SCREENSHOT_DELIVERIES=$(CURDIR)/docs/deliveries.png \
		CGO_ENABLED=1 $(GO) test -count=1 -run '^(TestStatusScreenshot|TestDeliveriesInBrowser)$$' .

clean:
	rm -rf switchyard $(TESTBIN) dist

# Debian's chromium, for the status page test.
ensure-chromium:
	@command -v chromium >/dev/null 2>&1 || { echo "installing chromium (headless, for the status page test)"; \
		$(SUDO) apt-get install -y -q --no-install-recommends chromium >/dev/null || \
		{ $(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q --no-install-recommends chromium >/dev/null; }; }

# promtool, taken out of Debian's prometheus package (the service is never
# installed or started).
$(PROMTOOL):
	@echo "fetching promtool from Debian's prometheus package"
	rm -rf $(TOOLS)/prometheus && mkdir -p $(TOOLS)/prometheus
	cd $(TOOLS)/prometheus && { apt-get download prometheus 2>/dev/null || { $(SUDO) apt-get update -q >/dev/null && apt-get download prometheus; }; }
	dpkg-deb -x $(TOOLS)/prometheus/prometheus_*.deb $(TOOLS)/prometheus/root
	cp $(TOOLS)/prometheus/root/usr/bin/promtool $(PROMTOOL)
	rm -rf $(TOOLS)/prometheus

# haproxy, taken out of Debian's package with the libraries it links (the
# service is never installed or started), for the test of the fleet behind
# deploy/haproxy.cfg.
$(HAPROXY):
	@echo "fetching haproxy from Debian's package"
	rm -rf $(TOOLS)/haproxy.d && mkdir -p $(TOOLS)/haproxy.d
	{ $(SUDO) apt-get install -y -q --no-install-recommends liblua5.3-0 libopentracing-c-wrapper0 >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q --no-install-recommends liblua5.3-0 libopentracing-c-wrapper0 >/dev/null; }; }
	cd $(TOOLS)/haproxy.d && { apt-get download haproxy 2>/dev/null || { $(SUDO) apt-get update -q >/dev/null && apt-get download haproxy; }; }
	dpkg-deb -x $(TOOLS)/haproxy.d/haproxy_*.deb $(TOOLS)/haproxy.d/root
	cp $(TOOLS)/haproxy.d/root/usr/sbin/haproxy $(HAPROXY)
	rm -rf $(TOOLS)/haproxy.d

# One trace per delivery, in a real collector: Jaeger's all-in-one, built
# once into .tools/ (keyed by its version) from tools/jaeger, a module of
# its own.
test-tracing: ensure-rabbitmq ensure-postgres $(JAEGER) $(TESTBIN)
	@$(TESTFN); JAEGER=$(CURDIR)/$(JAEGER) testrun -test.count=1 -test.run '^($(TRACE_TESTS))$$' -test.timeout 10m

$(JAEGER): tools/jaeger/go.mod tools/jaeger/go.sum
	@echo "building Jaeger v1.75.0 (a long build, once)"
	cd tools/jaeger && $(GO) build -o $(CURDIR)/$@ github.com/jaegertracing/jaeger/cmd/jaeger

# Pebble, Let's Encrypt's ACME test server, and its challenge test server
# (which answers DNS for the tests' domain), for the HTTPS tests: built from
# tools/pebble, a module of its own, so that the daemon's go.mod stays small.
$(PEBBLE): tools/pebble/go.mod tools/pebble/go.sum
	cd tools/pebble && $(GO) build -o $(CURDIR)/$@ github.com/letsencrypt/pebble/v2/cmd/$(notdir $@)

# pgbouncer, built from Debian 13's source package (the orig tarball of
# deb.debian.org's pool, checked against the SHA-256 of trixie's Sources):
# Debian 12's binary package, PgBouncer 1.18, aborts ("bad client state" in
# disconnect_client) when a cancel request's client leaves before the
# server it cancels, which a node that is killed or stopping does (fixed
# in 1.19.1; more crashes of its cancel handling with Go clients in
# 1.21.0). Built without c-ares, PAM or systemd; the service is
# never installed or started.
PGBOUNCER_VERSION := 1.24.1
PGBOUNCER_SHA256  := da72a3aba13072876d055a3e58dd4aba4a5de4ed6148e73033185245598fd3e0
$(PGBOUNCER):
	@echo "building pgbouncer $(PGBOUNCER_VERSION) from Debian's source package"
	rm -rf $(TOOLS)/pgbouncer.d && mkdir -p $(TOOLS)/pgbouncer.d
	{ $(SUDO) apt-get install -y -q --no-install-recommends libevent-dev libssl-dev pkg-config gcc make >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q --no-install-recommends libevent-dev libssl-dev pkg-config gcc make >/dev/null; }; }
	cd $(TOOLS)/pgbouncer.d && curl -fsSL -o src.tar.gz http://deb.debian.org/debian/pool/main/p/pgbouncer/pgbouncer_$(PGBOUNCER_VERSION).orig.tar.gz && \
		echo "$(PGBOUNCER_SHA256)  src.tar.gz" | sha256sum -c --quiet && tar xzf src.tar.gz
	cd $(TOOLS)/pgbouncer.d/pgbouncer-$(PGBOUNCER_VERSION) && ./configure -q --without-cares --without-pam --without-systemd >/dev/null && $(MAKE) -s >/dev/null 2>&1
	cp $(TOOLS)/pgbouncer.d/pgbouncer-$(PGBOUNCER_VERSION)/pgbouncer $(PGBOUNCER)
	rm -rf $(TOOLS)/pgbouncer.d

# PostgreSQL, which the tests use beside SQLite
# (SWITCHYARD_TEST_POSTGRES_URL, by default the local one), runs before the
# session and before CI on this kind of machine; start it if it has stopped.
ensure-postgres:
	@if [ -z "$$SWITCHYARD_TEST_POSTGRES_URL" ] && ! (echo > /dev/tcp/127.0.0.1/5432) 2>/dev/null; then \
		echo "starting PostgreSQL"; $(SUDO) pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql | head -1) main start || true; \
		for i in $$(seq 1 60); do (echo > /dev/tcp/127.0.0.1/5432) 2>/dev/null && break; sleep 1; done; \
	fi

# RabbitMQ runs before the session and before CI on this kind of machine; start
# it if it has stopped.
ensure-rabbitmq:
	@if ! (echo > /dev/tcp/127.0.0.1/5672) 2>/dev/null; then \
		echo "starting RabbitMQ"; rabbitmq-server -detached; \
		for i in $$(seq 1 60); do (echo > /dev/tcp/127.0.0.1/5672) 2>/dev/null && break; sleep 1; done; \
	fi
