package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// What anyone may read, /readyz and a webhook's answer (which GitHub
// shows on its Recent Deliveries page), names nothing of the account: a
// hosted plan's host, port, vhost and user are the account, and the
// broker's own text names them. Each failure says its kind in a fixed
// text; the operator's status and the log name the cause, with the user
// and the permission it lacks.
func TestPublicAnswersNameNothing(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	declareTestTopology(t, vhost, time.Second) // by the administrator
	user, password := newBrokerUser(t, vhost, "^$", "^$", ".*")
	down := newTCPProxy(t, testBrokerAddr())
	down.Close()
	host, port := "127.0.0.1", testBrokerAddr()[strings.LastIndex(testBrokerAddr(), ":")+1:]
	withUser := func(pw string) string {
		u := *testBroker().url
		u.User = url.UserPassword(user, pw)
		return u.String() + url.PathEscape(vhost)
	}
	cases := []struct {
		name, url, want string
		// operator is what the status and the log say of it.
		operator []string
	}{
		{"broker down", down.URL(vhost), "unreachable", []string{"connection refused"}},
		{"user without write permission", withUser(password), "refuses access",
			[]string{user, "lacks the write permission in vhost"}},
		{"wrong password", withUser("not-" + password), "refuses access",
			[]string{user, "was refused at login"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig(t, c.url)
			cfg.Queue.OutboxMaxBytes = 1 // the broker's path: the outbox full, each webhook published at the door (outbox_test.go has the outbox)
			cfg.Queue.DeclareTopology = false
			// RabbitMQ answers a refused login after 3 s.
			cfg.Queue.PublishTimeout = 10 * time.Second
			d := startDaemon(t, cfg)
			secrets := []string{host, vhost, user, password, "ACCESS_REFUSED", "refused for user", "connection refused", "vhost"}
			if c.name == "broker down" {
				secrets = append(secrets, down.addr[strings.LastIndex(down.addr, ":")+1:])
			} else {
				secrets = append(secrets, port)
			}
			named := func(what, body string) {
				t.Helper()
				for _, s := range secrets {
					if strings.Contains(body, s) {
						t.Errorf("%s names %q: %s", what, s, body)
					}
				}
			}

			guid := newGUID()
			code, body := do(t, webhookRequest(t, d.URL, "issues", guid, loadFixture(t, "issues", "opened")))
			if code != http.StatusServiceUnavailable || !strings.Contains(body, "broker "+c.want) || !strings.Contains(body, guid) {
				t.Errorf("webhook: %d %s, want 503 saying broker %s with the GUID", code, body, c.want)
			}
			named("the webhook's 503", body)
			// The refusal is kept for the operator, a 503 as the 4xx are.
			db := openStoreDB(t, cfg.Database)
			eventually(t, 20*time.Second, "the 503 recorded", func() bool {
				return queryInt(t, db, "SELECT count(*) FROM rejected_webhooks WHERE delivery_id = $1 AND status = 503 AND reason LIKE '%broker%'", guid) == 1
			})
			// The log line of the refused webhook carries its GUID and
			// hook ID.
			if !strings.Contains(d.logs.String(), `msg="webhook rejected" outcome=unavailable status=503 source_ip=127.0.0.1 delivery_id=`+guid+" hook_id=123456") {
				t.Errorf("no rejected webhook's log line names its GUID and hook ID")
			}

			resp, err := http.Get(d.URL + "/readyz")
			if err != nil {
				t.Fatal(err)
			}
			var ready struct {
				Status   string            `json:"status"`
				Problems map[string]string `json:"problems"`
			}
			var raw bytes.Buffer
			err = json.NewDecoder(io.TeeReader(resp.Body, &raw)).Decode(&ready)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusServiceUnavailable || ready.Problems["broker"] != c.want {
				t.Errorf("/readyz: %d %s (%v), want 503 with broker %q", resp.StatusCode, raw.String(), err, c.want)
			}
			named("/readyz", raw.String())

			var st Status
			_, text := do(t, mustRequestAuth(t, d.URL+"/api/v1/status"))
			if err := json.Unmarshal([]byte(text), &st); err != nil {
				t.Fatal(err)
			}
			problems := strings.Join(st.Problems, "\n")
			for _, want := range c.operator {
				if !strings.Contains(problems, want) {
					t.Errorf("the status's problems:\n%s\nwant them to say %q", problems, want)
				}
				if !strings.Contains(d.logs.String(), want) {
					t.Errorf("the log does not say %q", want)
				}
			}
			if c.want == "refuses access" && !strings.Contains(problems, "refuses access") {
				t.Errorf("the status's problems:\n%s\nwant the broker told as refusing access", problems)
			}
			if c.want == "refuses access" {
				// check-broker names the user and what it lacks too.
				var out bytes.Buffer
				err := checkBroker(context.Background(), cfg, 0, slog.New(slog.DiscardHandler), &out)
				told := out.String() + fmt.Sprint(err)
				if err == nil || !strings.Contains(told, `user "`+user+`"`) || !strings.Contains(told, c.operator[1][:strings.Index(c.operator[1], " ")]) {
					t.Errorf("check-broker as %s: %v\n%s\nwant it to fail naming the user and what it lacks", c.name, err, out.String())
				}
			}
		})
	}
}

// The status tells the present: once the broker is back and the workers
// consume again, their failures are 0 and `status` exits 0, within
// seconds, though each worker's window is 5 minutes long.
func TestStatusTellsThePresent(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	proxy := newTCPProxy(t, testBrokerAddr())
	cfg := testConfig(t, proxy.URL(vhost))
	cfg.Workers.Window = 5 * time.Minute
	d := startDaemon(t, cfg)
	c := *cfg
	c.Server.Listen = strings.TrimPrefix(d.URL, "http://")
	failures := func() float64 {
		m := scrape(t, d.URL+"/metrics")
		return m[`switchyard_worker_failures{worker="service"}`] + m[`switchyard_worker_failures{worker="database-service"}`]
	}
	eventually(t, 30*time.Second, "the workers consuming", func() bool {
		return printStatus(context.Background(), &c, false, &bytes.Buffer{}) == nil
	})

	proxy.Close()
	eventually(t, 30*time.Second, "status exiting 1 with the broker down", func() bool {
		var out bytes.Buffer
		err := printStatus(context.Background(), &c, false, &out)
		return err != nil && strings.Contains(out.String(), "failed") && failures() > 0
	})
	proxy.Reopen()
	var out bytes.Buffer
	eventually(t, 60*time.Second, "status exiting 0 once the workers consume again", func() bool {
		out.Reset()
		return printStatus(context.Background(), &c, false, &out) == nil
	})
	if f := failures(); f != 0 {
		t.Errorf("switchyard_worker_failures once consuming: %v, want 0", f)
	}
	for _, w := range d.workers[:2] { // service and database-service: cleanup's window is short
		if st := w.State(); st.Failures != 0 || st.LastError != "" || !st.WindowEnds.After(time.Now().Add(time.Minute)) {
			t.Errorf("worker %s: %+v; want no failure while its 5-minute window runs", w.Name, st)
		}
	}
}

// A publish that the broker refuses for github-database while github took
// it is told as it is: github stored, database-service waiting for a
// redelivery; GitHub's redelivery is then stored by database-service,
// which the story says, and the raw row is told as received again.
func TestStoryOfAHalfRefusedPublish(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Queue.OutboxMaxBytes = 1 // the broker's path: the outbox full, each webhook published at the door (outbox_test.go has the outbox)
	cfg.GitHub.BotAppID = testBotAppID
	d := startDaemon(t, cfg)
	rabbitmqctl(t, "set_policy", "-p", vhost, "--apply-to", "queues", "refuse", "^github-database$", `{"max-length":0,"overflow":"reject-publish"}`)
	body := loadFixture(t, "pull_request", "opened")
	guid := newGUID()
	req := func() *http.Request {
		r := webhookRequest(t, d.URL, "pull_request", guid, body)
		r.Header.Set("X-GitHub-Hook-Installation-Target-Type", "integration")
		r.Header.Set("X-GitHub-Hook-Installation-Target-ID", strconv.Itoa(testBotAppID))
		return r
	}
	eventually(t, 30*time.Second, "the policy in force", func() bool {
		code, _ := do(t, req())
		return code == http.StatusServiceUnavailable
	})
	db := openStoreDB(t, cfg.Database)
	eventually(t, 30*time.Second, "the github copy stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid) == 1
	})
	st, err := d.store.Story(context.Background(), guid)
	if err != nil {
		t.Fatal(err)
	}
	text := storyText(st)
	for _, want := range []string{"stored", "worker database-service\tnot yet", "a redelivery brings it"} {
		if !strings.Contains(text, want) {
			t.Errorf("the story of a half-refused publish:\n%s\nwant %q", text, want)
		}
	}

	rabbitmqctl(t, "clear_policy", "-p", vhost, "refuse")
	eventually(t, 30*time.Second, "the redelivery accepted", func() bool {
		code, _ := do(t, req())
		return code == http.StatusAccepted
	})
	waitDatabase(t, db, guid)
	// At least once: a nacked publish is sent again while publish_timeout
	// lasts, and each copy reaches github.
	eventually(t, 30*time.Second, "the raw row's duplicate counted", func() bool {
		return queryInt(t, db, "SELECT duplicates FROM github WHERE delivery_id = $1", guid) >= 1
	})
	if st, err = d.store.Story(context.Background(), guid); err != nil {
		t.Fatal(err)
	}
	text = storyText(st)
	for _, want := range []string{"worker database-service\tstored", "the raw row kept as it was", "typed row\tgithub_pull_requests"} {
		if !strings.Contains(text, want) {
			t.Errorf("the story after the redelivery:\n%s\nwant %q", text, want)
		}
	}
	for _, not := range []string{"changed nothing", "not yet"} {
		if strings.Contains(text, not) {
			t.Errorf("the story after the redelivery:\n%s\nsays %q", text, not)
		}
	}
}

// The delivery page of an event two hooks received shows each copy's
// payload under its hook ID, each with a download of that copy.
func TestDeliveryPageShowsEachCopy(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	d := startDaemon(t, cfg)
	db := openStoreDB(t, cfg.Database)
	guid := newGUID()
	bodies := map[bool][]byte{}
	for _, bot := range []bool{false, true} {
		bodies[bot] = mutate(t, loadFixture(t, "issues", "opened"), func(p map[string]any) {
			obj(p, "issue")["title"] = fmt.Sprintf("the copy for the bot: %t", bot)
		})
		if code := postCopy(t, d.URL, "issues", guid, bodies[bot], bot); code != http.StatusAccepted {
			t.Fatalf("copy (bot %t): %d", bot, code)
		}
	}
	eventually(t, 30*time.Second, "both copies stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid) == 2
	})
	get := func(path string) string {
		req, _ := http.NewRequest(http.MethodGet, d.URL+path, nil)
		req.SetBasicAuth("operator", "operator-token-for-tests")
		code, body := do(t, req)
		if code != http.StatusOK {
			t.Fatalf("%s: %d", path, code)
		}
		return body
	}
	page := get("/status/deliveries/" + guid)
	for bot, hook := range map[bool]int{false: testRepoHook, true: testAppHook} {
		head := fmt.Sprintf("<h2>Payload, hook %d</h2>", hook)
		i := strings.Index(page, head)
		if i < 0 {
			t.Errorf("the page has no %q", head)
			continue
		}
		section := page[i:]
		if j := strings.Index(section[len(head):], "<h2>"); j >= 0 {
			section = section[:len(head)+j]
		}
		title := fmt.Sprintf("the copy for the bot: %t", bot)
		if !strings.Contains(section, title) || !strings.Contains(section, fmt.Sprintf(`href="?download=1&amp;hook=%d"`, hook)) {
			t.Errorf("hook %d's payload section lacks its own payload or download:\n%s", hook, section)
		}
		if got := get(fmt.Sprintf("/status/deliveries/%s?download=1&hook=%d", guid, hook)); got != string(bodies[bot]) {
			t.Errorf("hook %d's download is not its copy's payload", hook)
		}
	}
}

// The database file holds every payload: it is created readable by its
// owner only, and so are its WAL and shared-memory files. received_at
// keeps the microseconds the README says.
func TestDatabaseFileModeAndTimes(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	d := startDaemon(t, cfg)
	guid := newGUID()
	if code := postWebhook(t, d.URL, "issues", guid, loadFixture(t, "issues", "opened")); code != http.StatusAccepted {
		t.Fatalf("webhook: %d", code)
	}
	db := openStoreDB(t, cfg.Database)
	eventually(t, 30*time.Second, "the webhook stored", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM github WHERE delivery_id = $1", guid) == 1
	})
	for _, p := range []string{cfg.Database.Path, cfg.Database.Path + "-wal", cfg.Database.Path + "-shm"} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %04o, want 0600", filepath.Base(p), fi.Mode().Perm())
		}
	}
	var received string
	if err := db.QueryRow("SELECT received_at FROM github WHERE delivery_id = $1", guid).Scan(&received); err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$`).MatchString(received) || strings.HasSuffix(received, ".000000Z") {
		t.Errorf("received_at %q, want the microseconds the webhook was taken at", received)
	}
}

// A config copied from the example (declare_topology = false) on a broker
// without the queues routes every webhook to no queue: /readyz stays 200
// (the outbox takes them) and names the broker's problem; the webhook is
// answered 202 queued and waits, the forwarder saying why, until the
// administrator declares the queues, and is stored then. With the outbox
// full (the broker's path) the webhook is refused 503 and /readyz is not
// ready.
func TestReadyzRoutesToNoQueue(t *testing.T) {
	t.Parallel()
	vhost := newVhost(t)
	cfg := testConfig(t, amqpURL(vhost))
	cfg.Queue.DeclareTopology = false
	d := startDaemon(t, cfg)
	readyz := func(d *testDaemon) (int, string) {
		return do(t, httpRequest(t, http.MethodGet, d.URL+"/readyz", "", ""))
	}
	if code, body := readyz(d); code != http.StatusOK || !strings.Contains(body, `"broker":"routes webhooks to no queue"`) {
		t.Errorf("/readyz without the queues: %d %s, want 200 saying webhooks route to no queue", code, body)
	}
	guid := newGUID()
	if code, body := do(t, webhookRequest(t, d.URL, "issues", guid, loadFixture(t, "issues", "opened"))); code != http.StatusAccepted ||
		!strings.Contains(body, `"queued"`) {
		t.Errorf("a webhook without the queues: %d %s, want 202 queued", code, body)
	}
	eventually(t, 20*time.Second, "the forwarder saying why it waits", func() bool {
		return strings.Contains(d.logs.String(), "the outbox waits") && strings.Contains(d.logs.String(), "routed to no queue")
	})
	d.stop(t)

	full := *cfg
	full.Queue.OutboxMaxBytes = 1 // the broker's path: the outbox full
	f := startDaemon(t, &full)
	if code, body := readyz(f); code != http.StatusServiceUnavailable || !strings.Contains(body, `"broker":"routes webhooks to no queue"`) ||
		!strings.Contains(body, `"outbox":"full"`) {
		t.Errorf("/readyz without the queues, the outbox full: %d %s, want 503 naming both", code, body)
	}
	if code, body := do(t, webhookRequest(t, f.URL, "issues", newGUID(), loadFixture(t, "issues", "opened"))); code != http.StatusServiceUnavailable ||
		!strings.Contains(body, "routes webhooks to no queue") || !strings.Contains(body, "not queued") {
		t.Errorf("a webhook without the queues, the outbox full: %d %s, want 503", code, body)
	}
	declareRouteAtOnce(t, vhost, time.Second) // while f's outbox tries the first webhook
	if code, body := readyz(f); code != http.StatusOK {
		t.Errorf("/readyz with the queues declared: %d %s, want 200", code, body)
	}
	if code := postWebhook(t, f.URL, "issues", newGUID(), loadFixture(t, "issues", "opened")); code != http.StatusAccepted {
		t.Errorf("a webhook with the queues declared: %d", code)
	}
	storedAll(t, cfg.Database, []string{guid}, 30*time.Second)
}
