package main

import "context"

// RegisterMetrics registers the gauges read from the database at each
// scrape, never from a worker's memory: the alert sender may be stuck on a
// stalled server, or the hooks worker on GitHub, exactly when the number
// matters.
func (s *Store) RegisterMetrics(m *Metrics) {
	if m == nil {
		return
	}
	m.GaugeFunc("switchyard_alerts_pending", "Alerts queued in alert_outbox and not sent yet.", s.AlertsPending)
	m.GaugeFunc("switchyard_delivery_gaps", "Open delivery gaps: deliveries GitHub made with a 2xx answer that are not stored after github.reconcile_grace.", s.OpenGapCount)
	m.GaugeFunc("switchyard_delivery_gaps_unrecoverable", "Open delivery gaps given up on: GitHub refused their redelivery three times, or its API listed them in a way no message may carry.", s.UnrecoverableGapCount)
	m.GaugeFunc("switchyard_database_writable", "1 when the database takes a write lock within 2 s, else 0.", func(ctx context.Context) (int, error) {
		if s.Writable(ctx) != nil {
			return 0, nil
		}
		return 1, nil
	})
}
