package main

import (
	"fmt"
	"net/url"
	"os"
	"sort"
	"strings"
)

// TracingConfig is [tracing]: OpenTelemetry traces of each delivery, from
// the door to the commit, sent by OTLP to a collector. Off unless
// endpoint is set, or, with no [tracing] section at all, the standard
// OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variables are.
type TracingConfig struct {
	// Endpoint is the collector: http(s)://host:port for OTLP over HTTP
	// (the path /v1/traces when none is given), grpc://host:port
	// (plain) or grpcs://host:port (TLS) for OTLP over gRPC.
	Endpoint string `toml:"endpoint"`
	// SampleRatio is the share of deliveries traced, 0 to 1 (1 by
	// default); a trace begun by an outside producer keeps its decision.
	SampleRatio float64 `toml:"sample_ratio"`
	// Headers go with every export (an API key): secrets, masked in the
	// summary.
	Headers map[string]string `toml:"headers"`
	// UIURL is a template of a trace's page, {trace_id} in it, that the
	// delivery's story links to.
	UIURL string `toml:"ui_url"`
	// Env is set when the section is absent and OTEL_* variables name an
	// endpoint: the SDK reads them.
	Env bool `toml:"-"`
}

// On reports whether traces are made.
func (c TracingConfig) On() bool { return c.Endpoint != "" || c.Env }

// tracingFromEnv is c, or, when the config file has no [tracing], traces
// as the standard OTEL_* variables say.
func tracingFromEnv(c TracingConfig, section bool) TracingConfig {
	if !section && (os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "") &&
		os.Getenv("OTEL_SDK_DISABLED") != "true" && os.Getenv("OTEL_TRACES_EXPORTER") != "none" {
		c.Env = true
	}
	return c
}

// problems are what cannot work in c, each naming its key.
func (c TracingConfig) problems() []error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, fmt.Errorf("tracing.%s: %s", key, fmt.Sprintf(format, args...)))
	}
	if c.Endpoint != "" {
		u, err := url.Parse(c.Endpoint)
		switch {
		case err != nil:
			bad("endpoint", "%v", err)
		case u.Host == "" || !strings.Contains("http https grpc grpcs", u.Scheme):
			bad("endpoint", "http(s)://host:port (OTLP over HTTP) or grpc(s)://host:port (OTLP over gRPC), got %q", c.Endpoint)
		}
	}
	if c.SampleRatio < 0 || c.SampleRatio > 1 {
		bad("sample_ratio", "between 0 and 1, got %g", c.SampleRatio)
	}
	if c.UIURL != "" && !strings.Contains(c.UIURL, "{trace_id}") {
		bad("ui_url", "a template with {trace_id} in it, got %q", c.UIURL)
	}
	return errs
}

// summary is what check-config prints of c, the headers' values masked.
func (c TracingConfig) summary() string {
	switch {
	case c.Endpoint != "":
		names := make([]string, 0, len(c.Headers))
		for k := range c.Headers {
			names = append(names, k+"=***")
		}
		sort.Strings(names)
		return fmt.Sprintf("tracing.endpoint = %q, sample_ratio = %g, headers = %v", c.Endpoint, c.SampleRatio, names)
	case c.Env:
		return "tracing: as the OTEL_* variables say"
	}
	return "tracing: off"
}
