package main

import (
	"fmt"
	"net/http"

	"github.com/julienschmidt/httprouter"
)

// The routes: the one place that knows every handler of the API.

// Handler returns the router with every route.
func (a *API) Handler() http.Handler {
	r := httprouter.New()
	r.Handler(http.MethodPost, "/webhooks/github", a.webhook)

	r.GET("/api/v1/broker", a.operator(a.getBroker))
	r.POST("/api/v1/broker/switch/:index", a.operator(a.switchBroker))
	r.POST("/api/v1/broker/pending-switch", a.producer(a.notifySwitch))
	r.DELETE("/api/v1/broker/pending-switch", a.operator(a.cancelSwitch))
	r.DELETE("/api/v1/broker/watermark", a.operator(a.clearWatermark))
	r.GET("/api/v1/status", a.operator(a.getStatus))
	r.GET("/api/v1/deliveries", a.operator(a.getDeliveries))
	r.GET("/api/v1/deliveries/:guid", a.operator(a.getDelivery))
	r.GET("/status", a.guarded(a.statusPage))
	r.GET("/status/deliveries", a.guarded(a.operatorPage(a.deliveriesPage)))
	r.GET("/status/deliveries/:guid", a.guarded(a.operatorPage(a.deliveryPage)))
	r.POST("/status/deliveries/:guid/replay", a.guarded(a.operatorPage(a.replayDelivery)))
	r.POST("/status/deliveries/:guid/redeliver", a.guarded(a.operatorPage(a.redeliverDelivery)))
	// A browser pointed at the daemon wants the status page.
	r.GET("/", func(w http.ResponseWriter, r *http.Request, _ httprouter.Params) {
		http.Redirect(w, r, "/status", http.StatusFound)
	})

	// The probes answer HEAD as GET (curl -sI): net/http writes no body.
	healthz := func(w http.ResponseWriter, _ *http.Request, _ httprouter.Params) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	}
	for _, method := range []string{http.MethodGet, http.MethodHead} {
		r.Handle(method, "/healthz", healthz)
		r.Handle(method, "/readyz", a.ready)
	}
	if a.cfg.Server.metricsOnAPI() {
		r.Handler(http.MethodGet, "/metrics", a.metrics.Handler())
	}

	r.NotFound = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, r, a.log, ErrNotFound)
	})
	r.MethodNotAllowed = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, r, a.log, ErrMethodNotAllowed)
	})
	r.PanicHandler = func(w http.ResponseWriter, r *http.Request, v any) {
		a.log.Error("panic in handler", "path", r.URL.Path, "panic", v)
		writeError(w, r, nil, fmt.Errorf("panic: %v", v))
	}
	return r
}
