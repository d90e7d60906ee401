-- switchyard's SQLite schema, as versioned migrations.
--
-- Each block starts with a line "-- migration N: what it does". store.go applies,
-- in one transaction each, the blocks whose N is above PRAGMA user_version, and
-- sets user_version to N in the same transaction. Never edit a block that has
-- shipped; add a new one below. Times are RFC 3339 UTC text.

-- migration 1: settings, the raw event log and its statistics
-- settings: small key/value state. The broker switch lives here (SPEC §8):
-- broker.active_index, broker.pending_switch (JSON, "" for none),
-- broker.last_switch (JSON, "" for none), broker.switch_watermark (RFC 3339).
CREATE TABLE settings (
    key        TEXT PRIMARY KEY,
    value      TEXT NOT NULL,
    updated_at TEXT NOT NULL
) STRICT;

-- github: one row per GitHub delivery, written by the service worker (and by
-- cleanup, with forbidden = 1). The raw payload is kept byte for byte.
CREATE TABLE github (
    id              INTEGER PRIMARY KEY,
    delivery_id     TEXT NOT NULL UNIQUE,     -- X-GitHub-Delivery GUID
    event           TEXT NOT NULL,            -- X-GitHub-Event
    action          TEXT NOT NULL DEFAULT '', -- payload "action", '' when none
    hook_id         INTEGER,                  -- X-GitHub-Hook-ID
    target_type     TEXT NOT NULL DEFAULT '', -- X-GitHub-Hook-Installation-Target-Type
    target_id       INTEGER,                  -- X-GitHub-Hook-Installation-Target-ID
    installation_id INTEGER,                  -- payload installation.id
    repository      TEXT NOT NULL DEFAULT '', -- payload repository.full_name (owner/name)
    sender          TEXT NOT NULL DEFAULT '', -- payload sender.login
    source_ip       TEXT NOT NULL DEFAULT '', -- the address the webhook came from
    forbidden       INTEGER NOT NULL DEFAULT 0 CHECK (forbidden IN (0, 1)), -- 1: source outside the allow list
    payload         TEXT NOT NULL,            -- the webhook's JSON body
    received_at     TEXT NOT NULL,            -- when the webhook endpoint took it
    processed_at    TEXT NOT NULL,            -- when this row was committed
    alerted_at      TEXT                      -- when its alert went out, NULL when none
) STRICT;
CREATE INDEX github_event_action ON github (event, action);
CREATE INDEX github_received_at ON github (received_at);

-- github_statistics_6h: deliveries per 6-hour UTC bucket (00, 06, 12, 18),
-- by the time the Event was received.
CREATE TABLE github_statistics_6h (
    bucket TEXT NOT NULL,             -- start of the bucket, e.g. 2026-11-29T06:00:00Z
    event  TEXT NOT NULL,
    action TEXT NOT NULL DEFAULT '',  -- '' when the payload has no action
    count  INTEGER NOT NULL,
    PRIMARY KEY (bucket, event, action)
) STRICT, WITHOUT ROWID;

-- worker_deliveries: which worker has finished which delivery, so a redelivered
-- or retried message is recognised as a duplicate by workers whose own tables
-- are not keyed by delivery (database-service, hooks).
CREATE TABLE worker_deliveries (
    worker       TEXT NOT NULL,
    delivery_id  TEXT NOT NULL,
    processed_at TEXT NOT NULL,
    PRIMARY KEY (worker, delivery_id)
) STRICT, WITHOUT ROWID;
