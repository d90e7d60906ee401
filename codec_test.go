package main

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Every reader of a message gives its payload back byte for byte, however
// the message came: compressed once at the door (the endpoint's zstd), or
// an outside producer's zstd (at another level, so other bytes), gzip or
// plain, through the consumers, the Leftover Drain and replay; the raw log
// keeps a zstd message's bytes as they came; the story (what `deliveries`
// shows), reprocess's reader and copy-db give each payload back;
// check-broker's large message travels as the daemon publishes it. Over
// the recorded shapes, a 25 MB payload and an empty one.
func TestMessagesGivenBackExactly(t *testing.T) {
	t.Parallel()
	onBothStores(t, testMessagesGivenBackExactly)
}

func testMessagesGivenBackExactly(t *testing.T) {
	ctx := context.Background()
	a, c := newVhost(t), newVhost(t)
	cfg := testConfig(t, amqpURL(a), amqpURL(c))
	declareTopologyOf(t, a, cfg.Queue)
	declareTopologyOf(t, c, cfg.Queue)
	spy := spyOn(t, a)
	foreign, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedBestCompression), zstd.WithEncoderCRC(false))
	if err != nil {
		t.Fatal(err)
	}
	encode := map[string]func([]byte) []byte{
		"":           func(b []byte) []byte { return b },
		encodingGzip: compressGzip,
		encodingZstd: func(b []byte) []byte { return foreign.EncodeAll(b, nil) },
	}
	encodings := []string{"", encodingGzip, encodingZstd}

	type sent struct {
		event    string
		payload  []byte
		encoding string // as it went to the broker
		body     []byte // the bytes it went as, when known
	}
	want := map[string]*sent{} // by GUID
	big := append(append([]byte(`{"action":"opened","issue":{"body":"`), bytes.Repeat([]byte(randHex(512)), (maxWebhookBody-64<<10)/1024)...), `"}}`...)
	fixtures := loadFixtures(t)

	// Outside producers first, before the daemon runs: on broker c, which
	// is neither active nor pending (the Leftover Drain's), and in a's
	// github-error (replay's), each shape in one of the three encodings.
	for i, f := range fixtures {
		for _, where := range []string{"drain", "replay"} {
			guid, enc := fmt.Sprintf("%s-%03d", where, i), encodings[i%3]
			msg := eventMessage(f.Event, guid, f.Body)
			msg.Body, msg.ContentEncoding = encode[enc](f.Body), enc
			if where == "drain" {
				publishRaw(t, c, exchangeName, "", msg)
			} else {
				publishRaw(t, a, "", errorQueue(queueGitHub), msg)
			}
			want[guid] = &sent{event: f.Event, payload: f.Body, encoding: enc, body: msg.Body}
		}
	}
	bigMsg := eventMessage("issues", "replay-big", big)
	bigMsg.Body, bigMsg.ContentEncoding = encode[encodingZstd](big), encodingZstd
	publishRaw(t, a, "", errorQueue(queueGitHub), bigMsg)
	want["replay-big"] = &sent{event: "issues", payload: big, encoding: encodingZstd, body: bigMsg.Body}

	d := startDaemon(t, cfg)
	eventually(t, 20*time.Second, "every node known to read zstd", func() bool { return d.queues.zstdReaders.Load() == zstdAll })
	for i, f := range fixtures {
		guid := fmt.Sprintf("door-%03d", i)
		if code, answer := do(t, webhookRequest(t, d.URL, f.Event, guid, f.Body)); code != 202 {
			t.Fatalf("%s/%s: %d %s", f.Event, f.Name, code, answer)
		}
		want[guid] = &sent{event: f.Event, payload: f.Body, encoding: encodingZstd}
	}
	if code, answer := do(t, webhookRequest(t, d.URL, "issues", "door-big", big)); code != 202 {
		t.Fatalf("the 25 MB webhook: %d %s", code, answer)
	}
	want["door-big"] = &sent{event: "issues", payload: big, encoding: encodingZstd}
	// What the endpoint published: zstd, each webhook compressed once. A
	// webhook whose confirm came late on a loaded machine is spooled
	// (its 202 then) and comes later, or twice: the spool's copy is the
	// same bytes.
	seen := map[string]bool{}
	eventually(t, 30*time.Second, "the spy's copy of every webhook the door took", func() bool {
		for {
			m, ok, err := spy.Get("spy", true)
			if err != nil {
				t.Fatalf("the spy's copy: %v", err)
			}
			if !ok {
				return len(seen) == len(fixtures)+1
			}
			w := want[m.MessageId]
			if w == nil || m.ContentEncoding != encodingZstd {
				t.Fatalf("the endpoint published %q with content_encoding %q, want a webhook's, zstd", m.MessageId, m.ContentEncoding)
			}
			if seen[m.MessageId] && !bytes.Equal(m.Body, w.body) {
				t.Errorf("%s published twice as different bytes (%d and %d)", m.MessageId, len(w.body), len(m.Body))
			}
			seen[m.MessageId], w.body = true, m.Body
		}
	})
	moved, total, err := d.queues.Replay(ctx, d.brokers.List()[0], d.brokers.List()[0], queueGitHub, 0, nil)
	if err != nil || moved != total || total != len(fixtures)+1 {
		t.Fatalf("replay: %d of %d, %v; want %d", moved, total, err, len(fixtures)+1)
	}

	// An empty body, zstd-compressed, is no JSON object: it goes to
	// -error as it came.
	empty := eventMessage("issues", "empty", nil)
	empty.Body, empty.ContentEncoding = foreign.EncodeAll(nil, nil), encodingZstd
	publishRaw(t, a, "", queueGitHub, empty)

	db := openStoreDB(t, cfg.Database)
	eventually(t, 2*time.Minute, "every message stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github") == len(want)
	})
	eventually(t, 20*time.Second, "the empty body in github-error", func() bool { return ready(t, a, errorQueue(queueGitHub)) == 1 })
	if m := getOne(t, a, errorQueue(queueGitHub)); m.ContentEncoding != encodingZstd || !bytes.Equal(m.Body, empty.Body) {
		t.Errorf("the empty body in github-error: %q, %d bytes; want it as it came", m.ContentEncoding, len(m.Body))
	}

	read := rawLog(t, d.store)
	for guid, w := range want {
		if got := storedPayload(t, d.store, guid); got != string(w.payload) {
			t.Errorf("%s (%q): the story gives back %d bytes, want the %d sent", guid, w.encoding, len(got), len(w.payload))
		}
		if c := read[guid]; c.Unreadable != nil || !bytes.Equal(c.Payload, w.payload) {
			t.Errorf("%s (%q): reprocess reads %d bytes (%v), want the %d sent", guid, w.encoding, len(c.Payload), c.Unreadable, len(w.payload))
		}
		var packed []byte
		if err := db.QueryRow("SELECT payload_zstd FROM github WHERE delivery_id = $1", guid).Scan(&packed); err != nil {
			t.Fatal(err)
		}
		if w.encoding == encodingZstd && !bytes.Equal(packed, w.body) {
			t.Errorf("%s: the raw log holds %d bytes, want the %d the message came as", guid, len(packed), len(w.body))
		}
	}

	// copy-db's reader, into a database of the other kind.
	other := postgresConfig(t)
	if cfg.Database.Driver == "postgres" {
		other = DefaultConfig().Database
		other.Path = t.TempDir() + "/copy.db"
	}
	dst := migratedStoreOf(t, other)
	if _, err := d.store.CopyTo(ctx, dst, nil); err != nil {
		t.Fatal(err)
	}
	copied := rawLog(t, dst)
	for guid, w := range want {
		if c := copied[guid]; !bytes.Equal(c.Payload, w.payload) {
			t.Errorf("%s: the copy gives back %d bytes (%v), want %d", guid, len(c.Payload), c.Unreadable, len(w.payload))
		}
	}

}

// A body compressed in any of the three ways reads back whole; a broken
// stream, one that inflates past maxInflated, or an encoding switchyard
// does not read is an error, not a crash.
func TestInflateBody(t *testing.T) {
	t.Parallel()
	body := loadFixture(t, "issues", "opened")
	for _, enc := range []string{"", "identity", encodingGzip, encodingZstd} {
		in := body
		switch enc {
		case encodingGzip:
			in = compressGzip(body)
		case encodingZstd:
			in = compressZstd(body)
		}
		if got, err := inflateBody(enc, in); err != nil || !bytes.Equal(got, body) {
			t.Errorf("%q: %d bytes (%v), want %d", enc, len(got), err, len(body))
		}
	}
	if got, err := inflateBody(encodingZstd, compressZstd(nil)); err != nil || len(got) != 0 {
		t.Errorf("an empty zstd body: %d bytes (%v), want none", len(got), err)
	}
	for name, c := range map[string]struct {
		enc  string
		body []byte
	}{
		"gzip bomb":   {encodingGzip, compressGzip(make([]byte, maxInflated+1))},
		"zstd bomb":   {encodingZstd, compressZstd(make([]byte, maxInflated+1))},
		"broken gzip": {encodingGzip, []byte("not gzip")},
		"broken zstd": {encodingZstd, []byte("not zstd at all")},
		"cut zstd":    {encodingZstd, compressZstd(body)[:20]},
		"unknown":     {"br", body},
	} {
		if got, err := inflateBody(c.enc, c.body); err == nil {
			t.Errorf("%s: read as %d bytes, want an error", name, len(got))
		}
	}
}

// A batch's bodies inflate into one room sized by their frames' headers,
// each intact however many came after it, whether it fitted or not; a
// room given back and taken for the next batch inflates it without
// allocating; a bomb or a broken body is refused as by inflateBody, and
// spoils nothing.
func TestInflateRoom(t *testing.T) {
	body := loadFixture(t, "issues", "opened")
	var want, packed [][]byte
	need, size := 0, 0
	for i := range 120 {
		b := append(bytes.Clone(body), fmt.Sprintf(" %d", i)...) // each its own
		want, packed = append(want, b), append(packed, compressZstd(b))
		need, size = need+inflatedSize(encodingZstd, packed[i]), size+len(b)
	}
	if need != size {
		t.Fatalf("the frames say %d bytes inflated, want %d", need, size)
	}
	for name, n := range map[string]int{
		"gzip":     inflatedSize(encodingGzip, compressGzip(body)),
		"plain":    inflatedSize("", body),
		"a bomb":   inflatedSize(encodingZstd, compressZstd(make([]byte, maxInflated+1))),
		"a broken": inflatedSize(encodingZstd, []byte("not zstd")),
	} {
		if n != 0 {
			t.Errorf("%s body is sized %d", name, n)
		}
	}
	for _, room := range []*inflateRoom{takeInflateRoom(need / 2), takeInflateRoom(need)} { // half fits, then all
		got := make([][]byte, len(packed))
		for i, p := range packed {
			b, err := room.body(encodingZstd, p)
			if err != nil {
				t.Fatalf("body %d: %v", i, err)
			}
			got[i] = b // checked once all are in
			if i == 60 {
				if _, err := room.body(encodingZstd, compressZstd(make([]byte, maxInflated+1))); err == nil {
					t.Fatal("a zstd bomb inflated")
				}
				if _, err := room.body(encodingZstd, p[:20]); err == nil {
					t.Fatal("a cut body inflated")
				}
				if b, err := room.body("", []byte("{}")); err != nil || string(b) != "{}" {
					t.Fatalf("a plain body: %q, %v", b, err)
				}
			}
		}
		for i := range want {
			if !bytes.Equal(got[i], want[i]) {
				t.Fatalf("body %d is %d bytes that are not its own, after the bodies behind it", i, len(got[i]))
			}
		}
		room.giveBack()
	}
	if raceEnabled {
		return // the pool drops rooms at random under the race detector
	}
	allocs := testing.AllocsPerRun(5, func() {
		room := takeInflateRoom(need)
		for _, p := range packed {
			if _, err := room.body(encodingZstd, p); err != nil {
				t.Fatal(err)
			}
		}
		room.giveBack()
	})
	if allocs >= float64(len(packed)/2) { // a slice each before rooms; a room now and then (when the collector took it)
		t.Errorf("a batch of %d bodies allocates %.0f times, want no slice of their own", len(packed), allocs)
	}
}

// Mixed versions: while a live node of an older version reads the queues
// (its row in nodes says nothing of zstd, or names another process's
// start, as when it took the name of a newer node), the endpoint publishes
// as before; once it is gone, zstd.
func TestZstdOnlyOnceEveryNodeReadsIt(t *testing.T) {
	t.Parallel()
	onBothStores(t, testZstdOnlyOnceEveryNodeReadsIt)
}

func testZstdOnlyOnceEveryNodeReadsIt(t *testing.T) {
	ctx := context.Background()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Server.LeaseTTL = minLeaseTTL
	declareTopologyOf(t, vhost, cfg.Queue)
	spy := spyOn(t, vhost)
	store := migratedStoreOf(t, cfg.Database)
	// The older node, seen all along until the test lets it go.
	var reads atomic.Value
	reads.Store("")
	stop, stopped := make(chan struct{}), make(chan struct{})
	see := func() {
		err := store.WriteTx(ctx, func(tx *Tx) error {
			if err := tx.SeeNode(ctx, "older", "0.9.0", time.Now()); err != nil {
				return err
			}
			_, err := tx.write(ctx, atOnce, "UPDATE nodes SET reads = $1 WHERE name = 'older'", reads.Load().(string))
			return err
		})
		if err != nil {
			t.Error(err)
		}
	}
	see()
	go func() {
		defer close(stopped)
		for {
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond):
				see()
			}
		}
	}()
	defer func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		<-stopped
	}()

	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)
	eventually(t, 20*time.Second, "the daemon's own row", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM nodes WHERE name = $1", cfg.Server.NodeName) == 1
	})
	// An earlier webhook may come twice (spooled once its confirm was
	// late, its first copy on the broker already): such a copy is passed.
	earlier := map[string]bool{}
	encodingOf := func(what string) string {
		t.Helper()
		guid := newGUID()
		if code := postWebhook(t, d.URL, "issues", guid, loadFixture(t, "issues", "opened")); code != 202 {
			t.Fatalf("%s: %d", what, code)
		}
		var m amqp.Delivery
		eventually(t, 10*time.Second, what+": the spy's copy", func() bool {
			for {
				var ok bool
				var err error
				if m, ok, err = spy.Get("spy", true); err != nil || !ok {
					return false
				}
				if !earlier[m.MessageId] {
					return true
				}
			}
		})
		if m.MessageId != guid {
			t.Fatalf("%s: the spy got %q, want %q", what, m.MessageId, guid)
		}
		earlier[guid] = true
		return m.ContentEncoding
	}
	if enc := encodingOf("an older node"); enc != "" {
		t.Errorf("beside an older node the endpoint published %q, want the payload as it came", enc)
	}
	if !strings.Contains(d.logs.String(), "a live node does not read zstd") {
		t.Errorf("no log line says why webhooks are not compressed")
	}
	reads.Store(readsZstd + "2020-01-01T00:00:00.000000Z") // a newer node's word, not this process's
	see()
	if enc := encodingOf("an older node under a newer one's name"); enc != "" {
		t.Errorf("beside an older node under a newer one's name the endpoint published %q, want the payload as it came", enc)
	}
	close(stop)
	<-stopped
	if _, err := store.w.Exec("DELETE FROM nodes WHERE name = 'older'"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "every node known to read zstd", func() bool { return d.queues.zstdReaders.Load() == zstdAll })
	if enc := encodingOf("the older node gone"); enc != encodingZstd {
		t.Errorf("with every node reading zstd the endpoint published %q, want zstd", enc)
	}
}

// queue.compress = "none" publishes as before: the body as it came, gzip
// over compress_over; "zstd" compresses once every node reads it, and
// leaves a body that would not shrink as it came.
func TestCompressSetting(t *testing.T) {
	t.Parallel()
	small, large := loadFixture(t, "issues", "opened"), largeIssue(t, 2<<20)
	b := &Broker{}
	for _, c := range []struct {
		compress string
		readers  bool
		body     []byte
		want     string
	}{
		{"zstd", true, small, encodingZstd},
		{"zstd", true, large, encodingZstd},
		{"zstd", true, []byte("{}"), ""},
		{"zstd", false, small, ""},
		{"zstd", false, large, encodingGzip},
		{"none", true, small, ""},
		{"none", true, large, encodingGzip},
	} {
		cfg := DefaultConfig().Queue
		cfg.Compress = c.compress
		q := &Queues{cfg: cfg, log: slog.New(slog.DiscardHandler)}
		q.SetZstdReaders(c.readers)
		msg, err := q.fit(b, amqp.Publishing{Body: c.body})
		if err != nil || msg.ContentEncoding != c.want {
			t.Errorf("compress %q, every node reading zstd %t, %d bytes: %q (%v), want %q", c.compress, c.readers, len(c.body), msg.ContentEncoding, err, c.want)
			continue
		}
		if got, err := inflateBody(msg.ContentEncoding, msg.Body); err != nil || !bytes.Equal(got, c.body) {
			t.Errorf("compress %q, %d bytes: read back %d bytes (%v)", c.compress, len(c.body), len(got), err)
		}
	}
}
