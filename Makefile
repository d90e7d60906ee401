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

.PHONY: build run test lint fuzz bench install deb screenshot clean ensure-rabbitmq ensure-postgres ensure-chromium

# Tools the tests need that Go does not bring, fetched here when missing.
TOOLS    := .tools
PROMTOOL := $(TOOLS)/promtool
HAPROXY  := $(TOOLS)/haproxy
SUDO     := $(if $(filter 0,$(shell id -u)),,sudo)
NFPM     := github.com/goreleaser/nfpm/v2/cmd/nfpm@v2.45.2

build:
	$(GO) build -trimpath -ldflags "-s -w -X main.version=$(VERSION)" -o switchyard .

# The daemon with the development config (CONFIG=PATH for another), a local
# database file and the local RabbitMQ.
run: build ensure-rabbitmq
	./switchyard serve -config $(CONFIG)

# -race needs cgo; the tests build their own binary where they need one.
# The tests run on SQLite and on the local PostgreSQL (each its own
# databases); -parallel 4 keeps both cores busy while tests wait on
# brokers and timers.
test: ensure-rabbitmq ensure-postgres ensure-chromium $(PROMTOOL) $(HAPROXY)
	PROMTOOL=$(CURDIR)/$(PROMTOOL) HAPROXY=$(CURDIR)/$(HAPROXY) CGO_ENABLED=1 $(GO) test -race -count=1 -parallel 4 -timeout 15m ./...

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
	for u in switchyard.service switchyard.socket; do \
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

# The Debian package: binary, unit, config (a conffile), rules and README;
# postinst creates the switchyard user and /var/lib/switchyard.
deb: build
	rm -rf dist/deb && mkdir -p dist/deb
	cp switchyard dist/deb/switchyard
	{ echo "# switchyard under systemd, from the Debian package (its postinst created the user)."; \
	  sed '/^# switchyard under systemd/,/^\[Unit\]/{/^#/d}; s|/usr/local/bin/switchyard|/usr/bin/switchyard|g; s|/usr/local/share/doc|/usr/share/doc|g' deploy/switchyard.service; \
	} > dist/deb/switchyard.service
	sed 's|/usr/local/share/doc|/usr/share/doc|g' deploy/switchyard.socket > dist/deb/switchyard.socket
	SWITCHYARD_DEB_VERSION=$(VERSION) $(GO) run $(NFPM) package -f deploy/nfpm.yaml -p deb -t dist/
	@ls dist/*.deb

# docs/status.png and docs/deliveries.png, the README's pictures: the status
# page (two brokers, a pending switch, a message in an -error queue) and a
# delivery's page after its replay from -error, in headless Chromium.
screenshot: ensure-rabbitmq ensure-chromium
	SWITCHYARD_SCREENSHOT=$(CURDIR)/docs/status.png SWITCHYARD_SCREENSHOT_DELIVERIES=$(CURDIR)/docs/deliveries.png \
		CGO_ENABLED=1 $(GO) test -count=1 -run '^(TestStatusScreenshot|TestDeliveriesInBrowser)$$' .

clean:
	rm -rf switchyard dist

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
