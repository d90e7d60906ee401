package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Sentinel errors of the broker state machine; the API maps them to statuses.
var (
	ErrUnknownBroker = errorKind(CodeNotFound, "no configured broker matches")
	ErrStale         = errors.New("notification is not newer than the last accepted one")
)

// Broker is one [[brokers]] entry. Its index is its position in the file.
type Broker struct {
	Index  int
	URL    string // with credentials: never log it, use String
	Scheme string
	Host   string
	Port   int
	Vhost  string // URL-decoded; "/" for the default vhost
	// User is the user switchyard logs in as, for the operator's view of
	// a refused access (never the password).
	User string
	// MaxMessageBytes is the largest message the broker takes
	// (brokers[].max_message_bytes); 0 when not known.
	MaxMessageBytes int64
}

// NewBroker is broker index as its [[brokers]] entry c configures it.
func NewBroker(index int, c BrokerConfig) (*Broker, error) {
	b, err := ParseBroker(index, c.URL)
	if err != nil {
		return nil, err
	}
	b.MaxMessageBytes = c.maxMessageBytes()
	return b, nil
}

// ParseBroker reads a broker URL the way amqp091-go dials it: the vhost is the
// URL-decoded path, and an empty path means "/".
func ParseBroker(index int, raw string) (*Broker, error) {
	u, err := parseBrokerURL(raw)
	if err != nil {
		return nil, err
	}
	return &Broker{Index: index, URL: raw, Scheme: u.Scheme, Host: u.Host, Port: u.Port, Vhost: normalizeVhost(u.Vhost),
		User: u.Username}, nil
}

// String names the broker without its credentials.
func (b *Broker) String() string {
	return fmt.Sprintf("#%d %s:%d vhost %s", b.Index, b.Host, b.Port, b.Vhost)
}

// PendingSwitch is a producer's notification that has not completed yet. It is
// stored by endpoint, not index, so a reordered [[brokers]] list cannot point
// it at the wrong broker.
type PendingSwitch struct {
	Index      int       `json:"index"`
	Host       string    `json:"host"`
	Vhost      string    `json:"vhost"`
	SwitchedAt time.Time `json:"switched_at"`
	RecordedAt time.Time `json:"recorded_at"`
}

// LastSwitch records the last completed move, for GET /api/v1/broker only.
type LastSwitch struct {
	From        int       `json:"from"`
	To          int       `json:"to"`
	Reason      string    `json:"reason"` // "drained" or "operator"
	SwitchedAt  time.Time `json:"switched_at"`
	CompletedAt time.Time `json:"completed_at"`
}

// SwitchState is the broker state machine as stored in settings.
type SwitchState struct {
	Active    int
	Pending   *PendingSwitch
	Last      *LastSwitch
	Watermark time.Time
}

// Settings keys of the state machine.
const (
	keyActiveIndex   = "broker.active_index"
	keyPendingSwitch = "broker.pending_switch"
	keyLastSwitch    = "broker.last_switch"
	keyWatermark     = "broker.switch_watermark"
)

// Brokers is the configured list plus the active / pending / last switch state
// machine kept in settings. Every change is one transaction, and wakes the
// workers so that they re-read the state at once.
type Brokers struct {
	list    []*Broker
	store   *Store
	log     *slog.Logger
	metrics *Metrics

	mu      sync.Mutex
	changed chan struct{} // closed, and replaced, on every change
	cached  SwitchState   // the state after the last read or change
	version uint64        // counts changes: a read begun before one is not cached

	// changes serializes changes from their transaction to their publish, so
	// that they are published in the order they committed. No network I/O
	// happens under it, and reads never wait for it.
	changes sync.Mutex

	// node names this node among those sharing the database (JoinNodes),
	// "" for a process alone with it; a node not seen for goneAfter is
	// gone.
	node      string
	goneAfter time.Duration
}

// JoinNodes makes bs node's, one of the nodes sharing the database, whose
// rows say they are alive within lease_ttl: a Pending Switch completes
// only once every live node found the active broker drained, with nothing
// of it in hand (CompleteIfDrained).
func (bs *Brokers) JoinNodes(node string, leaseTTL time.Duration) {
	bs.node, bs.goneAfter = node, 3*leaseTTL
}

// Shared reports whether other nodes may change the state: the database
// is shared.
func (bs *Brokers) Shared() bool { return bs.store.Shared() }

// Refresh reads the state and, when another node changed it since, makes
// it this node's: published, so that the workers end their windows and the
// webhook routes by it, as for a change made here.
func (bs *Brokers) Refresh(ctx context.Context) error {
	// Under changes: no change of this node's lands between the read and
	// the publish.
	bs.changes.Lock()
	defer bs.changes.Unlock()
	st, err := bs.read(ctx, bs.store.Settings)
	if err != nil {
		return err
	}
	bs.mu.Lock()
	changed := !st.same(bs.cached)
	bs.mu.Unlock()
	if changed {
		bs.log.Info("broker state changed by another node", "active", st.Active, "pending", st.Pending != nil)
		bs.publish(st)
	}
	return nil
}

// Follow refreshes the state every interval until ctx ends: nodes
// sharing the database see another's change within it.
func (bs *Brokers) Follow(ctx context.Context, interval time.Duration) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if err := bs.Refresh(ctx); err != nil && ctx.Err() == nil {
			bs.log.Debug("cannot read the broker state", "error", err)
		}
	}
}

// same reports whether st and o are the same state.
func (st SwitchState) same(o SwitchState) bool {
	samePending := (st.Pending == nil) == (o.Pending == nil) && (st.Pending == nil ||
		st.Pending.Index == o.Pending.Index && st.Pending.SwitchedAt.Equal(o.Pending.SwitchedAt))
	sameLast := (st.Last == nil) == (o.Last == nil) && (st.Last == nil ||
		st.Last.From == o.Last.From && st.Last.To == o.Last.To && st.Last.CompletedAt.Equal(o.Last.CompletedAt))
	return st.Active == o.Active && samePending && sameLast && st.Watermark.Equal(o.Watermark)
}

// NewBrokers parses the configured brokers and reads the stored state.
// metrics may be nil (the commands that record none).
func NewBrokers(ctx context.Context, cfgs []BrokerConfig, store *Store, metrics *Metrics, log *slog.Logger) (*Brokers, error) {
	bs := &Brokers{store: store, metrics: metrics, log: log, changed: make(chan struct{})}
	for i, c := range cfgs {
		b, err := NewBroker(i, c)
		if err != nil {
			return nil, fmt.Errorf("brokers[%d].url: %w", i, err)
		}
		bs.list = append(bs.list, b)
	}
	if _, err := bs.State(ctx); err != nil {
		return nil, err
	}
	return bs, nil
}

// List returns the configured brokers in order.
func (bs *Brokers) List() []*Broker { return bs.list }

// Get returns the broker at index i, or ErrUnknownBroker.
func (bs *Brokers) Get(i int) (*Broker, error) {
	if i < 0 || i >= len(bs.list) {
		return nil, errorf(CodeNotFound, "%s: index %d of %d", ErrUnknownBroker.Message, i, len(bs.list))
	}
	return bs.list[i], nil
}

// Match finds the broker with this endpoint: host case-insensitive, vhost after
// URL decoding, "" and "/" alike. Never by index: the producer's list and ours
// need not be in the same order.
func (bs *Brokers) Match(host, vhost string) (*Broker, error) {
	if v, err := url.PathUnescape(vhost); err == nil {
		vhost = v
	}
	vhost = normalizeVhost(vhost)
	for _, b := range bs.list {
		if strings.EqualFold(b.Host, host) && b.Vhost == vhost {
			return b, nil
		}
	}
	return nil, errorf(CodeNotFound, "%s: host %q vhost %q", ErrUnknownBroker.Message, host, vhost)
}

// Watch returns a channel closed at the next change of state. Take it before
// reading the state, so that no change falls between the two.
func (bs *Brokers) Watch() <-chan struct{} {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	return bs.changed
}

// Unchanged reports whether no change happened since watch was taken. The
// Leftover Drain asks it for each message it takes: a change is published
// (watch closed) before the request that made it is answered, so once a
// notification has been answered no worker still acting on the state before
// it takes a message from the new target, and a producer that publishes to a
// broker after naming it is never drained early.
func Unchanged(watch <-chan struct{}) bool {
	select {
	case <-watch:
		return false
	default:
		return true
	}
}

// Cached returns the state as of the last read or change, without a query.
// The webhook endpoint routes by it: every change goes through this process.
func (bs *Brokers) Cached() SwitchState {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	return bs.cached
}

// publish records a committed state and wakes everyone watching.
func (bs *Brokers) publish(st SwitchState) {
	bs.metrics.brokerState(st.Active, st.Pending != nil)
	bs.mu.Lock()
	defer bs.mu.Unlock()
	bs.version++
	bs.cached = st
	close(bs.changed)
	bs.changed = make(chan struct{})
}

// State reads the state machine from the database and refreshes the cache,
// unless a change was published while it read: a read begun just before a
// change could otherwise land after it and put the old state back in the
// cache (a webhook then went to the old broker while a switch was pending).
// The version number says so without a lock held across the read.
func (bs *Brokers) State(ctx context.Context) (SwitchState, error) {
	bs.mu.Lock()
	version := bs.version
	bs.mu.Unlock()
	st, err := bs.read(ctx, bs.store.Settings)
	if err != nil {
		return st, err
	}
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if bs.version == version {
		bs.cached = st
		bs.metrics.brokerState(st.Active, st.Pending != nil)
	}
	return st, nil
}

// read decodes the four settings, read in one query. A stored pending
// target that is no longer configured reads as none; an active index past
// the end reads as 0.
func (bs *Brokers) read(ctx context.Context, settings func(context.Context, ...string) (map[string]string, error)) (SwitchState, error) {
	var st SwitchState
	vals, err := settings(ctx, keyActiveIndex, keyPendingSwitch, keyLastSwitch, keyWatermark)
	if err != nil {
		return st, err
	}
	if v := vals[keyActiveIndex]; v != "" {
		i, err := strconv.Atoi(v)
		if err != nil || i < 0 || i >= len(bs.list) {
			bs.log.Warn("stored active broker is not configured, using broker 0", "broker.active_index", v)
			i = 0
		}
		st.Active = i
	}
	if v := vals[keyPendingSwitch]; v != "" {
		var p PendingSwitch
		if err := json.Unmarshal([]byte(v), &p); err != nil {
			bs.log.Warn("stored pending switch is unreadable, ignoring it", "error", err)
		} else if b, err := bs.Match(p.Host, p.Vhost); err != nil {
			bs.log.Warn("stored pending switch target is not configured, ignoring it", "host", p.Host, "vhost", p.Vhost)
		} else {
			p.Index = b.Index
			st.Pending = &p
		}
	}
	if v := vals[keyLastSwitch]; v != "" {
		var l LastSwitch
		if err := json.Unmarshal([]byte(v), &l); err == nil {
			st.Last = &l
		}
	}
	if v := vals[keyWatermark]; v != "" {
		if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
			st.Watermark = t
		}
	}
	return st, nil
}

// change runs fn over the current state inside one write transaction, then
// publishes the result. fn returns the new state and whether it changed.
func (bs *Brokers) change(ctx context.Context, fn func(tx *Tx, st SwitchState, now time.Time) (SwitchState, bool, error)) (SwitchState, error) {
	return bs.changeUnder(ctx, nil, fn)
}

// changeUnder is change made under fence, when it is set (a once-only
// job's: Store.WriteTxUnder).
func (bs *Brokers) changeUnder(ctx context.Context, fence *Fence, fn func(tx *Tx, st SwitchState, now time.Time) (SwitchState, bool, error)) (SwitchState, error) {
	bs.changes.Lock()
	defer bs.changes.Unlock()
	var out SwitchState
	var changed bool
	err := bs.store.writeTx(ctx, fence, false, func(tx *Tx) error {
		// Nodes sharing the database change it one at a time: each reads
		// the state the last change committed.
		if err := tx.Lock(ctx, "broker switch"); err != nil {
			return err
		}
		st, err := bs.read(ctx, tx.Settings)
		if err != nil {
			return err
		}
		out, changed, err = fn(tx, st, time.Now().UTC())
		return err
	})
	if err != nil {
		return out, err
	}
	if changed {
		bs.publish(out)
	}
	return out, nil
}

func writeJSONSetting(ctx context.Context, tx *Tx, key string, v any, now time.Time) error {
	s := ""
	if v != nil {
		b, err := json.Marshal(v)
		if err != nil {
			return err
		}
		s = string(b)
	}
	return tx.SetSetting(ctx, key, s, now)
}

// SwitchTo is the operator's switch: it moves now and drops any Pending Switch.
// The watermark stays, so a late copy of an old notification cannot undo it.
func (bs *Brokers) SwitchTo(ctx context.Context, index int) (SwitchState, error) {
	if _, err := bs.Get(index); err != nil {
		return SwitchState{}, err
	}
	return bs.change(ctx, func(tx *Tx, st SwitchState, now time.Time) (SwitchState, bool, error) {
		last := &LastSwitch{From: st.Active, To: index, Reason: "operator", SwitchedAt: now, CompletedAt: now}
		if err := tx.SetSetting(ctx, keyActiveIndex, strconv.Itoa(index), now); err != nil {
			return st, false, err
		}
		if err := tx.SetSetting(ctx, keyPendingSwitch, "", now); err != nil {
			return st, false, err
		}
		if err := writeJSONSetting(ctx, tx, keyLastSwitch, last, now); err != nil {
			return st, false, err
		}
		st.Active, st.Pending, st.Last = index, nil, last
		bs.metrics.switched("operator")
		return st, true, nil
	})
}

// Notify takes the producer's word that it now publishes to host/vhost as of
// switchedAt. It returns "pending" when a Pending Switch was recorded, "active"
// when the target is already the active broker (any Pending Switch cleared), or
// ErrStale when switchedAt is not newer than the watermark, changing nothing.
func (bs *Brokers) Notify(ctx context.Context, host, vhost string, switchedAt time.Time) (string, SwitchState, error) {
	return bs.NotifyUnder(ctx, nil, host, vhost, switchedAt)
}

// NotifyUnder is Notify made under fence, when it is set: the rotation's,
// which a once-only job records as a producer's notification.
func (bs *Brokers) NotifyUnder(ctx context.Context, fence *Fence, host, vhost string, switchedAt time.Time) (string, SwitchState, error) {
	target, err := bs.Match(host, vhost)
	if err != nil {
		return "", SwitchState{}, err
	}
	var result string
	st, err := bs.changeUnder(ctx, fence, func(tx *Tx, st SwitchState, now time.Time) (SwitchState, bool, error) {
		if !switchedAt.After(st.Watermark) {
			return st, false, ErrStale
		}
		// At full precision: stored at microseconds, a notification with
		// nanoseconds would be newer than its own watermark, and accepted
		// again after an operator switch.
		if err := tx.SetSetting(ctx, keyWatermark, switchedAt.UTC().Format(time.RFC3339Nano), now); err != nil {
			return st, false, err
		}
		st.Watermark = switchedAt
		if target.Index == st.Active {
			result = "active"
			st.Pending = nil
			return st, true, tx.SetSetting(ctx, keyPendingSwitch, "", now)
		}
		result = "pending"
		st.Pending = &PendingSwitch{Index: target.Index, Host: target.Host, Vhost: target.Vhost,
			SwitchedAt: switchedAt.UTC(), RecordedAt: now}
		return st, true, writeJSONSetting(ctx, tx, keyPendingSwitch, st.Pending, now)
	})
	return result, st, err
}

// ClearWatermark forgets the last accepted notification's switchedAt.
func (bs *Brokers) ClearWatermark(ctx context.Context) (SwitchState, error) {
	return bs.change(ctx, func(tx *Tx, st SwitchState, now time.Time) (SwitchState, bool, error) {
		st.Watermark = time.Time{}
		return st, true, tx.SetSetting(ctx, keyWatermark, "", now)
	})
}

// CancelPending drops the Pending Switch without moving. It reports whether
// there was one.
func (bs *Brokers) CancelPending(ctx context.Context) (bool, SwitchState, error) {
	var had bool
	st, err := bs.change(ctx, func(tx *Tx, st SwitchState, now time.Time) (SwitchState, bool, error) {
		if st.Pending == nil {
			return st, false, nil
		}
		had = true
		st.Pending = nil
		return st, true, tx.SetSetting(ctx, keyPendingSwitch, "", now)
	})
	return had, st, err
}

// CompleteIfDrained flips to the Pending Switch's target when drained reports
// the active broker empty. The check runs outside the transaction (it talks to
// the broker); the flip re-reads the state inside it and happens only if the
// same Pending Switch is still there on the same active broker, so workers
// checking at once produce one flip and one last_switch.
func (bs *Brokers) CompleteIfDrained(ctx context.Context, drained func(ctx context.Context, b *Broker) (bool, error)) (bool, error) {
	st, err := bs.State(ctx)
	if err != nil || st.Pending == nil {
		return false, err
	}
	active, err := bs.Get(st.Active)
	if err != nil {
		return false, err
	}
	ok, err := drained(ctx, active)
	if err != nil || !ok {
		return false, err
	}
	// Nodes sharing the database each find it drained, each with
	// nothing of it in hand, before one completes the switch.
	key := st.Pending.SwitchedAt.UTC().Format(time.RFC3339Nano)
	if bs.node != "" {
		if err := bs.store.WriteTx(ctx, func(tx *Tx) error { return tx.VoteDrained(ctx, bs.node, key) }); err != nil {
			return false, err
		}
	}
	flipped := false
	_, err = bs.change(ctx, func(tx *Tx, cur SwitchState, now time.Time) (SwitchState, bool, error) {
		if cur.Pending == nil || cur.Active != st.Active || cur.Pending.Index != st.Pending.Index ||
			!cur.Pending.SwitchedAt.Equal(st.Pending.SwitchedAt) {
			return cur, false, nil
		}
		if bs.node != "" {
			if all, err := tx.AllDrained(ctx, key, bs.goneAfter); err != nil || !all {
				return cur, false, err
			}
		}
		last := &LastSwitch{From: cur.Active, To: cur.Pending.Index, Reason: "drained",
			SwitchedAt: cur.Pending.SwitchedAt, CompletedAt: now}
		if err := tx.SetSetting(ctx, keyActiveIndex, strconv.Itoa(last.To), now); err != nil {
			return cur, false, err
		}
		if err := tx.SetSetting(ctx, keyPendingSwitch, "", now); err != nil {
			return cur, false, err
		}
		if err := writeJSONSetting(ctx, tx, keyLastSwitch, last, now); err != nil {
			return cur, false, err
		}
		cur.Active, cur.Pending, cur.Last = last.To, nil, last
		flipped = true
		return cur, true, nil
	})
	if flipped {
		bs.metrics.switched("drained")
		bs.log.Info("pending switch completed", "from", st.Active, "to", st.Pending.Index)
	}
	return flipped, err
}

// PublishTarget is where the webhook endpoint publishes: the Pending Switch's
// target while one exists (where the producer publishes and the workers read
// next), else the active broker.
func (st SwitchState) PublishTarget() int {
	if st.Pending != nil {
		return st.Pending.Index
	}
	return st.Active
}
