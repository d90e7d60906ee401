-- switchyard's SQLite schema, as versioned migrations.
--
-- Each block starts with a line "-- migration N: what it does". store.go applies,
-- in one transaction each, the blocks whose N is above PRAGMA user_version, and
-- sets user_version to N in the same transaction. Never edit a block that has
-- shipped; add a new one below. Times are RFC 3339 UTC text.

-- migration 1: settings, the raw event log and its statistics
-- settings: small key/value state. The broker switch lives here:
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

-- migration 2: release tracking and the typed bot tables
-- github_releases: release tracking for every repository (database-service).
-- One row per release; an Event older than the stored row never overwrites it.
CREATE TABLE github_releases (
    release_id        INTEGER PRIMARY KEY,      -- release.id
    repository        TEXT NOT NULL,            -- repository.full_name
    tag_name          TEXT NOT NULL,            -- release.tag_name
    name              TEXT NOT NULL DEFAULT '', -- release.name
    draft             INTEGER NOT NULL DEFAULT 0 CHECK (draft IN (0, 1)),
    prerelease        INTEGER NOT NULL DEFAULT 0 CHECK (prerelease IN (0, 1)),
    author            TEXT NOT NULL DEFAULT '', -- release.author.login
    html_url          TEXT NOT NULL DEFAULT '',
    last_action       TEXT NOT NULL,            -- the action of the Event that wrote the row
    created_at        TEXT,                     -- release.created_at
    published_at      TEXT,                     -- release.published_at, NULL while a draft
    deleted           INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1)), -- 1 after a "deleted" Event
    github_updated_at TEXT NOT NULL,            -- release.updated_at, or when the Event was received: orders Events
    delivery_id       TEXT NOT NULL,            -- the delivery that wrote the row
    updated_at        TEXT NOT NULL             -- when switchyard wrote the row
) STRICT;
CREATE INDEX github_releases_repository_tag ON github_releases (repository, tag_name);

-- github_release_workflow_runs: workflow runs of every repository, linked to a
-- release tag when the run was triggered by a release or runs on a tag that
-- is a known release. One row per run; an older updated_at never overwrites.
CREATE TABLE github_release_workflow_runs (
    run_id            INTEGER PRIMARY KEY,      -- workflow_run.id
    repository        TEXT NOT NULL,
    workflow_name     TEXT NOT NULL DEFAULT '', -- workflow_run.name
    head_branch       TEXT NOT NULL DEFAULT '',
    head_sha          TEXT NOT NULL DEFAULT '',
    event             TEXT NOT NULL DEFAULT '', -- what triggered the run (push, release, ...)
    status            TEXT NOT NULL DEFAULT '', -- requested, queued, in_progress, completed
    conclusion        TEXT NOT NULL DEFAULT '', -- '' until completed
    run_number        INTEGER NOT NULL DEFAULT 0,
    run_attempt       INTEGER NOT NULL DEFAULT 0,
    html_url          TEXT NOT NULL DEFAULT '',
    github_updated_at TEXT NOT NULL,            -- workflow_run.updated_at: orders Events
    release_tag       TEXT,                     -- the release tag the run belongs to, NULL when none
    delivery_id       TEXT NOT NULL,
    updated_at        TEXT NOT NULL
) STRICT;
CREATE INDEX github_release_workflow_runs_tag ON github_release_workflow_runs (repository, release_tag);

-- The typed bot tables: only Events of the bot App (target type "integration",
-- target id = github.bot_app_id). Every row carries the delivery that last
-- changed it (delivery_id, hook_id, target_type, target_id, installation_id)
-- and a processing_state: switchyard writes NEW, RE_REQUESTED and UPDATED, the
-- bot PROCESSING and PROCESSED. processing_date is when the state last changed;
-- created_at and updated_at when switchyard inserted and last changed the row.

-- github_branches: create and delete Events, one row per delivery.
CREATE TABLE github_branches (
    id               INTEGER PRIMARY KEY,
    delivery_id      TEXT NOT NULL UNIQUE,
    hook_id          INTEGER,
    target_type      TEXT NOT NULL DEFAULT '',
    target_id        INTEGER,
    installation_id  INTEGER,
    event            TEXT NOT NULL,             -- create or delete
    repository       TEXT NOT NULL,
    ref              TEXT NOT NULL,             -- the branch or tag name
    ref_type         TEXT NOT NULL,             -- branch or tag
    master_branch    TEXT NOT NULL DEFAULT '',  -- create only: the default branch
    sender           TEXT NOT NULL DEFAULT '',
    processing_state TEXT NOT NULL CHECK (processing_state IN ('NEW', 'RE_REQUESTED', 'UPDATED', 'PROCESSING', 'PROCESSED')),
    processing_date  TEXT NOT NULL,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL
) STRICT;

-- github_issues: one row per issue (node id); states as the README's table for pull requests and issues.
CREATE TABLE github_issues (
    id               INTEGER PRIMARY KEY,
    node_id          TEXT NOT NULL UNIQUE,      -- issue.node_id
    delivery_id      TEXT NOT NULL,
    hook_id          INTEGER,
    target_type      TEXT NOT NULL DEFAULT '',
    target_id        INTEGER,
    installation_id  INTEGER,
    repository_owner TEXT NOT NULL,
    repository_name  TEXT NOT NULL,
    number           INTEGER NOT NULL,
    title            TEXT NOT NULL DEFAULT '',
    sender           TEXT NOT NULL DEFAULT '',
    state            TEXT NOT NULL CHECK (state IN ('OPEN', 'CLOSED')),
    last_action      TEXT NOT NULL,
    processing_state TEXT NOT NULL CHECK (processing_state IN ('NEW', 'RE_REQUESTED', 'UPDATED', 'PROCESSING', 'PROCESSED')),
    processing_date  TEXT NOT NULL,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL
) STRICT;

-- github_pull_requests: one row per pull request (node id); states as the README's table for pull requests and issues.
CREATE TABLE github_pull_requests (
    id               INTEGER PRIMARY KEY,
    node_id          TEXT NOT NULL UNIQUE,      -- pull_request.node_id
    delivery_id      TEXT NOT NULL,
    hook_id          INTEGER,
    target_type      TEXT NOT NULL DEFAULT '',
    target_id        INTEGER,
    installation_id  INTEGER,
    repository_owner TEXT NOT NULL,
    repository_name  TEXT NOT NULL,
    number           INTEGER NOT NULL,
    title            TEXT NOT NULL DEFAULT '',
    sender           TEXT NOT NULL DEFAULT '',
    state            TEXT NOT NULL CHECK (state IN ('OPEN', 'CLOSED')),
    last_action      TEXT NOT NULL,
    head_ref         TEXT NOT NULL DEFAULT '',  -- pull_request.head.ref
    head_sha         TEXT NOT NULL DEFAULT '',  -- pull_request.head.sha
    merged           INTEGER NOT NULL DEFAULT 0 CHECK (merged IN (0, 1)),
    draft            INTEGER NOT NULL DEFAULT 0 CHECK (draft IN (0, 1)),
    processing_state TEXT NOT NULL CHECK (processing_state IN ('NEW', 'RE_REQUESTED', 'UPDATED', 'PROCESSING', 'PROCESSED')),
    processing_date  TEXT NOT NULL,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL
) STRICT;

-- github_comments: issue_comment, pull_request_review_comment and
-- commit_comment Events, one row per comment id.
CREATE TABLE github_comments (
    id               INTEGER PRIMARY KEY,
    comment_id       INTEGER NOT NULL UNIQUE,   -- comment.id
    delivery_id      TEXT NOT NULL,
    hook_id          INTEGER,
    target_type      TEXT NOT NULL DEFAULT '',
    target_id        INTEGER,
    installation_id  INTEGER,
    event            TEXT NOT NULL,             -- which of the three comment Events
    repository       TEXT NOT NULL,
    number           INTEGER,                   -- issue or pull request number; NULL on commit comments
    commit_id        TEXT NOT NULL DEFAULT '',  -- comment.commit_id (review and commit comments)
    path             TEXT NOT NULL DEFAULT '',  -- comment.path, '' when not on a file
    author           TEXT NOT NULL DEFAULT '',  -- comment.user.login
    body             TEXT NOT NULL DEFAULT '',  -- comment.body
    html_url         TEXT NOT NULL DEFAULT '',
    deleted          INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1)),
    last_action      TEXT NOT NULL,
    processing_state TEXT NOT NULL CHECK (processing_state IN ('NEW', 'RE_REQUESTED', 'UPDATED', 'PROCESSING', 'PROCESSED')),
    processing_date  TEXT NOT NULL,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL
) STRICT;

-- github_discussions: discussion and discussion_comment Events, one row per
-- discussion (node id); a comment updates its discussion's row.
CREATE TABLE github_discussions (
    id               INTEGER PRIMARY KEY,
    node_id          TEXT NOT NULL UNIQUE,      -- discussion.node_id
    delivery_id      TEXT NOT NULL,
    hook_id          INTEGER,
    target_type      TEXT NOT NULL DEFAULT '',
    target_id        INTEGER,
    installation_id  INTEGER,
    repository       TEXT NOT NULL,
    number           INTEGER NOT NULL,
    title            TEXT NOT NULL DEFAULT '',
    category         TEXT NOT NULL DEFAULT '',  -- discussion.category.name
    state            TEXT NOT NULL DEFAULT '',  -- discussion.state
    sender           TEXT NOT NULL DEFAULT '',
    last_event       TEXT NOT NULL,             -- discussion or discussion_comment
    last_action      TEXT NOT NULL,
    last_comment_id  INTEGER,                   -- comment.id of the last discussion_comment
    processing_state TEXT NOT NULL CHECK (processing_state IN ('NEW', 'RE_REQUESTED', 'UPDATED', 'PROCESSING', 'PROCESSED')),
    processing_date  TEXT NOT NULL,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL
) STRICT;

-- github_check_runs: check_run Events, one row per check run id.
CREATE TABLE github_check_runs (
    id               INTEGER PRIMARY KEY,
    check_run_id     INTEGER NOT NULL UNIQUE,   -- check_run.id
    delivery_id      TEXT NOT NULL,
    hook_id          INTEGER,
    target_type      TEXT NOT NULL DEFAULT '',
    target_id        INTEGER,
    installation_id  INTEGER,
    repository       TEXT NOT NULL,
    name             TEXT NOT NULL DEFAULT '',
    head_sha         TEXT NOT NULL DEFAULT '',
    status           TEXT NOT NULL DEFAULT '',
    conclusion       TEXT NOT NULL DEFAULT '',  -- '' until completed
    html_url         TEXT NOT NULL DEFAULT '',
    requested_action TEXT NOT NULL DEFAULT '',  -- requested_action.identifier
    last_action      TEXT NOT NULL,
    processing_state TEXT NOT NULL CHECK (processing_state IN ('NEW', 'RE_REQUESTED', 'UPDATED', 'PROCESSING', 'PROCESSED')),
    processing_date  TEXT NOT NULL,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL
) STRICT;

-- github_pushes: push Events, one row per repository and head commit (the
-- "after" sha, which is all zeros when a ref is deleted).
CREATE TABLE github_pushes (
    id               INTEGER PRIMARY KEY,
    delivery_id      TEXT NOT NULL,
    hook_id          INTEGER,
    target_type      TEXT NOT NULL DEFAULT '',
    target_id        INTEGER,
    installation_id  INTEGER,
    repository       TEXT NOT NULL,
    head_commit      TEXT NOT NULL,             -- after
    ref              TEXT NOT NULL,
    before           TEXT NOT NULL DEFAULT '',
    pusher           TEXT NOT NULL DEFAULT '',  -- pusher.name
    commits          INTEGER NOT NULL DEFAULT 0, -- how many commits the push carried
    created          INTEGER NOT NULL DEFAULT 0 CHECK (created IN (0, 1)),
    deleted          INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1)),
    forced           INTEGER NOT NULL DEFAULT 0 CHECK (forced IN (0, 1)),
    processing_state TEXT NOT NULL CHECK (processing_state IN ('NEW', 'RE_REQUESTED', 'UPDATED', 'PROCESSING', 'PROCESSED')),
    processing_date  TEXT NOT NULL,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL,
    UNIQUE (repository, head_commit)
) STRICT;

-- github_installations: installation and installation_repositories Events,
-- one row per installation id.
CREATE TABLE github_installations (
    id                   INTEGER PRIMARY KEY,
    installation_id      INTEGER NOT NULL UNIQUE,  -- installation.id
    delivery_id          TEXT NOT NULL,
    hook_id              INTEGER,
    target_type          TEXT NOT NULL DEFAULT '',
    target_id            INTEGER,
    account              TEXT NOT NULL DEFAULT '', -- installation.account.login
    account_type         TEXT NOT NULL DEFAULT '', -- User or Organization
    repository_selection TEXT NOT NULL DEFAULT '', -- all or selected
    app_id               INTEGER,                  -- installation.app_id
    suspended            INTEGER NOT NULL DEFAULT 0 CHECK (suspended IN (0, 1)),
    deleted              INTEGER NOT NULL DEFAULT 0 CHECK (deleted IN (0, 1)),
    last_event           TEXT NOT NULL,
    last_action          TEXT NOT NULL,
    processing_state     TEXT NOT NULL CHECK (processing_state IN ('NEW', 'RE_REQUESTED', 'UPDATED', 'PROCESSING', 'PROCESSED')),
    processing_date      TEXT NOT NULL,
    created_at           TEXT NOT NULL,
    updated_at           TEXT NOT NULL
) STRICT;

-- github_repositories: an append-only log of repository Events and of each
-- repository added to or removed from an installation, one row per delivery
-- and repository.
CREATE TABLE github_repositories (
    id               INTEGER PRIMARY KEY,
    delivery_id      TEXT NOT NULL,
    hook_id          INTEGER,
    target_type      TEXT NOT NULL DEFAULT '',
    target_id        INTEGER,
    installation_id  INTEGER,
    event            TEXT NOT NULL,             -- repository or installation_repositories
    action           TEXT NOT NULL,             -- created, renamed, ... or added, removed
    repository       TEXT NOT NULL,             -- full_name
    repository_id    INTEGER,
    private          INTEGER CHECK (private IN (0, 1)),
    sender           TEXT NOT NULL DEFAULT '',
    processing_state TEXT NOT NULL CHECK (processing_state IN ('NEW', 'RE_REQUESTED', 'UPDATED', 'PROCESSING', 'PROCESSED')),
    processing_date  TEXT NOT NULL,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL,
    UNIQUE (delivery_id, repository)
) STRICT;

-- migration 3: hooks redelivery and alert bookkeeping
-- hook_redeliveries: what the hooks worker queued on github-hooks, so that a
-- GUID is queued once. The poll's checkpoint is the setting hooks.checkpoint.
CREATE TABLE hook_redeliveries (
    guid           TEXT PRIMARY KEY,          -- X-GitHub-Delivery of the failed delivery
    delivery_id    INTEGER NOT NULL,          -- GitHub's id of the attempt to fetch
    event          TEXT NOT NULL DEFAULT '',
    queued_at      TEXT NOT NULL,             -- when the message went to github-hooks
    republished_at TEXT                       -- when the consumer republished the Event
) STRICT;

-- alert_sends: which alert channel has sent which delivery's alert, so that a
-- retry after a failed send repeats only what failed. github.alerted_at is
-- set once every channel has sent.
CREATE TABLE alert_sends (
    delivery_id TEXT NOT NULL,
    channel     TEXT NOT NULL,                -- email or push
    sent_at     TEXT NOT NULL,
    PRIMARY KEY (delivery_id, channel)
) STRICT, WITHOUT ROWID;

-- migration 4: alerts sent after the commit
-- alert_outbox: an alert to send, written in the Event's own transaction and
-- sent by the alert sender after the commit, so that no network
-- I/O happens while a transaction is open and a stalled SMTP or push server
-- never slows storing. One row per delivery and channel; github.alerted_at is
-- set when the last of a delivery's rows is sent. alert_sends (migration 3)
-- is no longer written.
CREATE TABLE alert_outbox (
    id          INTEGER PRIMARY KEY,
    delivery_id TEXT NOT NULL,                -- the github row it announces
    channel     TEXT NOT NULL,                -- email or push
    created_at  TEXT NOT NULL,
    attempts    INTEGER NOT NULL DEFAULT 0,   -- failed sends so far
    last_error  TEXT NOT NULL DEFAULT '',     -- why the last send failed
    next_at     TEXT NOT NULL,                -- not tried again before this (backoff)
    sent_at     TEXT,                         -- NULL until sent
    UNIQUE (delivery_id, channel)
) STRICT;
CREATE INDEX alert_outbox_due ON alert_outbox (channel, next_at) WHERE sent_at IS NULL;

-- migration 5: order-safe typed rows and the delivery ledger
-- github_updated_at: the payload object's updated_at (a check run has none:
-- its completed_at, else started_at), in the stored time format. A row is
-- never overwritten by an Event whose object is older; such an
-- Event is recorded in worker_deliveries with outcome 'stale'. NULL reads as
-- older than anything. Rows written before this migration take the time
-- from the payload of the delivery that last wrote them, while its raw row
-- is kept.
ALTER TABLE github_issues ADD COLUMN github_updated_at TEXT;
ALTER TABLE github_pull_requests ADD COLUMN github_updated_at TEXT;
ALTER TABLE github_comments ADD COLUMN github_updated_at TEXT;
ALTER TABLE github_discussions ADD COLUMN github_updated_at TEXT;
ALTER TABLE github_check_runs ADD COLUMN github_updated_at TEXT;
UPDATE github_issues SET github_updated_at = (SELECT strftime('%Y-%m-%dT%H:%M:%f',
    json_extract(g.payload, '$.issue.updated_at')) || '000Z' FROM github g WHERE g.delivery_id = github_issues.delivery_id);
UPDATE github_pull_requests SET github_updated_at = (SELECT strftime('%Y-%m-%dT%H:%M:%f',
    json_extract(g.payload, '$.pull_request.updated_at')) || '000Z' FROM github g WHERE g.delivery_id = github_pull_requests.delivery_id);
UPDATE github_comments SET github_updated_at = (SELECT strftime('%Y-%m-%dT%H:%M:%f',
    json_extract(g.payload, '$.comment.updated_at')) || '000Z' FROM github g WHERE g.delivery_id = github_comments.delivery_id);
UPDATE github_discussions SET github_updated_at = (SELECT strftime('%Y-%m-%dT%H:%M:%f',
    json_extract(g.payload, '$.discussion.updated_at')) || '000Z' FROM github g WHERE g.delivery_id = github_discussions.delivery_id);
UPDATE github_check_runs SET github_updated_at = (SELECT strftime('%Y-%m-%dT%H:%M:%f',
    coalesce(json_extract(g.payload, '$.check_run.completed_at'), json_extract(g.payload, '$.check_run.started_at'))) || '000Z'
    FROM github g WHERE g.delivery_id = github_check_runs.delivery_id);

-- worker_deliveries.outcome: 'done', or 'stale' when the Event's object was
-- older than the typed row (the row kept the newer one).
ALTER TABLE worker_deliveries ADD COLUMN outcome TEXT NOT NULL DEFAULT 'done' CHECK (outcome IN ('done', 'stale'));

-- delivery_gaps: deliveries GitHub made with a 2xx answer that are not stored
-- after github.reconcile_grace: lost by a broker, stranded on
-- a broker nobody reads, or waiting in an -error queue. Resolved when the
-- GUID is stored.
CREATE TABLE delivery_gaps (
    guid           TEXT PRIMARY KEY,  -- X-GitHub-Delivery
    delivery_id    INTEGER NOT NULL,  -- GitHub's id of the latest attempt (for redelivery)
    event          TEXT NOT NULL,
    delivered_at   TEXT NOT NULL,     -- the first 2xx attempt
    found_at       TEXT NOT NULL,
    redelivered_at TEXT,              -- when GitHub was asked to deliver it again
    resolved_at    TEXT               -- when the GUID was found stored
) STRICT;
CREATE INDEX delivery_gaps_open ON delivery_gaps (found_at) WHERE resolved_at IS NULL;

-- migration 6: identities that outlive payloads, unrecoverable gaps
-- github.payload_pruned_at: when retention emptied the payload
-- (database.raw_retention). The row stays as the delivery's identity (its
-- GUID, when it was received) until database.delivery_retention, so that a
-- redelivery of it is a duplicate and the ledger counts it stored.
ALTER TABLE github ADD COLUMN payload_pruned_at TEXT;
-- delivery_gaps.refusals: redeliveries GitHub refused (404, 410, 422);
-- unrecoverable_at: when the gap was given up on (three refusals, or a
-- GUID, event or header from GitHub's API that no message may carry), with
-- last_error saying why. An unrecoverable gap is never asked for again.
ALTER TABLE delivery_gaps ADD COLUMN refusals INTEGER NOT NULL DEFAULT 0;
ALTER TABLE delivery_gaps ADD COLUMN unrecoverable_at TEXT;
ALTER TABLE delivery_gaps ADD COLUMN last_error TEXT NOT NULL DEFAULT '';
CREATE INDEX worker_deliveries_processed_at ON worker_deliveries (processed_at);

-- migration 7: what each broker costs
-- broker_usage: the messages switchyard published to and had delivered from
-- each broker ("host/vhost"), per UTC hour: what a free plan's monthly quota
-- counts. A budget month is the sum of its hours; the last 24 hours give the
-- rate the month-end projection uses.
CREATE TABLE broker_usage (
    broker    TEXT NOT NULL,
    hour      TEXT NOT NULL,
    published INTEGER NOT NULL DEFAULT 0,
    delivered INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (broker, hour)
) STRICT, WITHOUT ROWID;

-- migration 8: the deliveries search
-- Newest-first pages of github narrowed by event, repository or sender read
-- these in order instead of sorting what matches.
CREATE INDEX github_event_received ON github (event, received_at);
CREATE INDEX github_repository_received ON github (repository, received_at);
CREATE INDEX github_sender_received ON github (sender, received_at);
-- Deliveries an order-safe table found stale are few: the search finds them here.
CREATE INDEX worker_deliveries_stale ON worker_deliveries (delivery_id) WHERE outcome = 'stale';

-- migration 9: duplicate receipts
-- github.duplicates: how often the delivery came again after it was stored
-- (GitHub's redelivery, a broker's); last_duplicate_at: the last time.
ALTER TABLE github ADD COLUMN duplicates INTEGER NOT NULL DEFAULT 0;
ALTER TABLE github ADD COLUMN last_duplicate_at TEXT;

-- migration 10: GitHub's attempts
-- github_attempts: GitHub's own attempts at each delivery, as the hooks
-- poll lists them (the App's hook deliveries): when, and what switchyard
-- answered as GitHub saw it, for a delivery's story. Kept as long as GitHub
-- keeps its deliveries (72 hours).
CREATE TABLE github_attempts (
    attempt_id   INTEGER PRIMARY KEY,
    guid         TEXT NOT NULL,
    delivered_at TEXT NOT NULL,
    status_code  INTEGER NOT NULL,
    status       TEXT NOT NULL,
    redelivery   INTEGER NOT NULL
);
CREATE INDEX github_attempts_guid ON github_attempts (guid);
CREATE INDEX github_attempts_delivered_at ON github_attempts (delivered_at);

-- migration 11: forbidden deliveries found fast
-- The deliveries search's forbidden outcome reads these, newest first,
-- instead of looking through every row for the few that are.
CREATE INDEX github_forbidden_received ON github (received_at) WHERE forbidden = 1;

-- migration 12: the broker a delivery came through
-- github.broker: the broker ("host/vhost") the stored delivery was consumed
-- from, for its story; empty for deliveries stored before.
ALTER TABLE github ADD COLUMN broker TEXT NOT NULL DEFAULT '';

-- migration 13: one event, many hooks
-- GitHub sends one event to every hook that subscribes to it (a repository
-- or organization webhook, each App) under the same X-GitHub-Delivery GUID,
-- told apart by X-GitHub-Hook-ID. A delivery is therefore (hook, GUID): each
-- hook's copy has its own github row and its own worker records, and only a
-- copy for the same hook again is a duplicate. Rows stored before keep their
-- hook (0 where none was recorded), so what was a duplicate stays one.
-- worker_deliveries first, while github still has one row per GUID to take
-- each record's hook from; the hooks worker's own records are about the
-- App's deliveries and keep hook 0.
CREATE TABLE worker_deliveries_by_hook (
    worker       TEXT NOT NULL,
    delivery_id  TEXT NOT NULL,
    hook_id      INTEGER NOT NULL DEFAULT 0,  -- X-GitHub-Hook-ID of the copy, 0 when none
    processed_at TEXT NOT NULL,
    outcome      TEXT NOT NULL DEFAULT 'done' CHECK (outcome IN ('done', 'stale')),
    PRIMARY KEY (worker, delivery_id, hook_id)
) STRICT, WITHOUT ROWID;
INSERT INTO worker_deliveries_by_hook (worker, delivery_id, hook_id, processed_at, outcome)
    SELECT w.worker, w.delivery_id,
        CASE WHEN w.worker = 'hooks' THEN 0
            ELSE coalesce((SELECT g.hook_id FROM github g WHERE g.delivery_id = w.delivery_id), 0) END,
        w.processed_at, w.outcome
    FROM worker_deliveries w;
DROP TABLE worker_deliveries;
ALTER TABLE worker_deliveries_by_hook RENAME TO worker_deliveries;
CREATE INDEX worker_deliveries_processed_at ON worker_deliveries (processed_at);
CREATE INDEX worker_deliveries_stale ON worker_deliveries (delivery_id, hook_id) WHERE outcome = 'stale';

CREATE TABLE github_by_hook (
    id                INTEGER PRIMARY KEY,
    delivery_id       TEXT NOT NULL,            -- X-GitHub-Delivery GUID: one per event, shared by its hooks
    event             TEXT NOT NULL,            -- X-GitHub-Event
    action            TEXT NOT NULL DEFAULT '', -- payload "action", '' when none
    hook_id           INTEGER NOT NULL DEFAULT 0, -- X-GitHub-Hook-ID, 0 when none
    target_type       TEXT NOT NULL DEFAULT '', -- X-GitHub-Hook-Installation-Target-Type
    target_id         INTEGER,                  -- X-GitHub-Hook-Installation-Target-ID
    installation_id   INTEGER,                  -- payload installation.id
    repository        TEXT NOT NULL DEFAULT '', -- payload repository.full_name (owner/name)
    sender            TEXT NOT NULL DEFAULT '', -- payload sender.login
    source_ip         TEXT NOT NULL DEFAULT '', -- the address the webhook came from
    forbidden         INTEGER NOT NULL DEFAULT 0 CHECK (forbidden IN (0, 1)), -- 1: source outside the allow list
    payload           TEXT NOT NULL,            -- the webhook's JSON body, '' once pruned
    received_at       TEXT NOT NULL,            -- when the webhook endpoint took it
    processed_at      TEXT NOT NULL,            -- when this row was committed
    alerted_at        TEXT,                     -- when its alert went out, NULL when none
    payload_pruned_at TEXT,                     -- when retention emptied the payload
    duplicates        INTEGER NOT NULL DEFAULT 0, -- how often this hook's copy came again
    last_duplicate_at TEXT,
    broker            TEXT NOT NULL DEFAULT '', -- the broker ("host/vhost") it was consumed from
    UNIQUE (delivery_id, hook_id)
) STRICT;
INSERT INTO github_by_hook (id, delivery_id, event, action, hook_id, target_type, target_id, installation_id,
        repository, sender, source_ip, forbidden, payload, received_at, processed_at, alerted_at,
        payload_pruned_at, duplicates, last_duplicate_at, broker)
    SELECT id, delivery_id, event, action, coalesce(hook_id, 0), target_type, target_id, installation_id,
        repository, sender, source_ip, forbidden, payload, received_at, processed_at, alerted_at,
        payload_pruned_at, duplicates, last_duplicate_at, broker
    FROM github;
DROP TABLE github;
ALTER TABLE github_by_hook RENAME TO github;
CREATE INDEX github_event_action ON github (event, action);
CREATE INDEX github_received_at ON github (received_at);
CREATE INDEX github_event_received ON github (event, received_at);
CREATE INDEX github_repository_received ON github (repository, received_at);
CREATE INDEX github_sender_received ON github (sender, received_at);
CREATE INDEX github_forbidden_received ON github (received_at) WHERE forbidden = 1;
-- The deliveries search narrowed to one hook's copies reads this in order.
CREATE INDEX github_hook_received ON github (hook_id, received_at);

-- migration 14: github_attempts is STRICT, as every table is
CREATE TABLE github_attempts_strict (
    attempt_id   INTEGER PRIMARY KEY,
    guid         TEXT NOT NULL,
    delivered_at TEXT NOT NULL,
    status_code  INTEGER NOT NULL,
    status       TEXT NOT NULL,
    redelivery   INTEGER NOT NULL CHECK (redelivery IN (0, 1))
) STRICT;
INSERT INTO github_attempts_strict (attempt_id, guid, delivered_at, status_code, status, redelivery)
    SELECT attempt_id, CAST(guid AS TEXT), CAST(delivered_at AS TEXT), CAST(status_code AS INTEGER), CAST(status AS TEXT),
        CASE WHEN redelivery THEN 1 ELSE 0 END
    FROM github_attempts;
DROP TABLE github_attempts;
ALTER TABLE github_attempts_strict RENAME TO github_attempts;
CREATE INDEX github_attempts_guid ON github_attempts (guid);
CREATE INDEX github_attempts_delivered_at ON github_attempts (delivered_at);

-- migration 15: several nodes, one store: the migrations applied, leases, nodes
-- schema_migrations: every migration applied; the database's version is
-- the greatest, kept the same way on PostgreSQL (schema_postgres.sql).
-- PRAGMA user_version is still set, so that an older binary refuses a
-- newer database. Versions applied before this table have applied_at NULL.
CREATE TABLE schema_migrations (
    version    INTEGER PRIMARY KEY,
    name       TEXT NOT NULL,
    applied_at TEXT
) STRICT;

-- leases: who runs each job that must run once among the nodes (on SQLite
-- the one node holds them all). expires_at is on the database's clock.
CREATE TABLE leases (
    job        TEXT PRIMARY KEY,
    node       TEXT NOT NULL,
    expires_at TEXT NOT NULL,
    taken_at   TEXT NOT NULL
) STRICT;

-- nodes: the serve processes sharing the database (on SQLite, one).
CREATE TABLE nodes (
    name       TEXT PRIMARY KEY,
    version    TEXT NOT NULL,
    started_at TEXT NOT NULL,
    seen_at    TEXT NOT NULL,
    drained    TEXT NOT NULL DEFAULT ''
) STRICT;

-- migration 16: an event's first copy, told by a unique key
-- github.first_copy: 1 on the first stored copy of each event (GUID), NULL
-- on the copies for other hooks that came after it. The unique index
-- decides which copy is first, in the writing transaction, even when two
-- nodes store two copies at once: the event is counted in the statistics
-- and alerted at that copy only.
ALTER TABLE github ADD COLUMN first_copy INTEGER CHECK (first_copy = 1);
UPDATE github SET first_copy = 1 WHERE id IN (SELECT min(id) FROM github GROUP BY delivery_id);
CREATE UNIQUE INDEX github_first_copy ON github (delivery_id) WHERE first_copy = 1;

-- migration 17: the raw log compressed
-- github.payload_zstd: the payload compressed with zstd, payload then
-- empty. Rows written before keep their payload as text until the
-- retention job compresses them, a few hundred at a time; a pruned row has
-- neither.
ALTER TABLE github ADD COLUMN payload_zstd BLOB;
-- migration 18: refused webhooks kept
-- rejected_webhooks: each webhook answered 4xx or 5xx, as the request claimed
-- it (never its body or signature): the newest 10,000 of the last 7 days,
-- written at most 100 a second (RejectLog).
CREATE TABLE rejected_webhooks (
    id          INTEGER PRIMARY KEY,
    received_at TEXT NOT NULL,              -- when it was answered
    source_ip   TEXT NOT NULL DEFAULT '',
    event       TEXT NOT NULL DEFAULT '',   -- X-GitHub-Event, '' when missing or not a name
    delivery_id TEXT NOT NULL DEFAULT '',   -- X-GitHub-Delivery, '' when missing or not a GUID
    hook_id     INTEGER,                    -- X-GitHub-Hook-ID, NULL when missing or malformed
    status      INTEGER NOT NULL,           -- the HTTP status answered
    reason      TEXT NOT NULL               -- why, as the log line says it
) STRICT;
CREATE INDEX rejected_webhooks_received ON rejected_webhooks (received_at);
CREATE INDEX rejected_webhooks_delivery ON rejected_webhooks (delivery_id);
-- migration 19: each migration's floor
-- schema_migrations.floor: the oldest schema version whose binaries still
-- work with a database of this version (a rolling upgrade runs two
-- versions on one database); NULL before it was kept, read as the version
-- itself. A migration says its floor in a "-- floor: N" line; one that
-- does not keeps the one before it (an additive change). The database's
-- floor is the greatest, and a binary of an older version refuses it.
-- floor: 19
ALTER TABLE schema_migrations ADD COLUMN floor INTEGER;
-- migration 20: lease terms
-- leases.term: raised each time another node takes the lease (a new one is
-- term 1), so that a once-only job's writes name the holding they are made
-- under, and a stale holder's change nothing (Fence). Additive: the floor
-- stays.
ALTER TABLE leases ADD COLUMN term INTEGER NOT NULL DEFAULT 0;
-- migration 21: what each node reads
-- nodes.reads: the content encodings a node reads beyond gzip, and the
-- start of the process that said so ("zstd " || started_at): a node of an
-- older version writes none, and one that replaced a newer node under its
-- name leaves the newer one's, which no longer names its start. The
-- endpoint compresses with zstd only while every live node reads it.
-- Additive: the floor stays.
ALTER TABLE nodes ADD COLUMN reads TEXT NOT NULL DEFAULT '';
-- migration 22: the spool
-- spooled_webhooks: webhooks the broker did not confirm in time (or
-- refused, blocked, could not be reached), committed here and answered
-- 202: each the message as it would have been published (exchange and
-- routing key, headers as a JSON object, the body as compressed). The
-- spool is the rows not yet published; the spool drain publishes them
-- oldest first (received_at, id) to where the endpoint publishes, then
-- drops the row's message (body and headers emptied) and sets
-- published_at: the times stay for the delivery's story 7 days. Additive:
-- an older node neither reads nor writes it, so the floor stays.
CREATE TABLE spooled_webhooks (
    id               INTEGER PRIMARY KEY,
    delivery_id      TEXT NOT NULL,
    hook_id          INTEGER,                   -- NULL when none
    event            TEXT NOT NULL,
    received_at      TEXT NOT NULL,             -- at the door
    spooled_at       TEXT NOT NULL,
    node             TEXT NOT NULL,             -- the node that took it
    broker           INTEGER NOT NULL,          -- the broker it was meant for
    reason           TEXT NOT NULL,             -- why the broker did not take it
    exchange         TEXT NOT NULL,
    routing_key      TEXT NOT NULL,
    headers          TEXT NOT NULL,
    content_encoding TEXT NOT NULL DEFAULT '',
    body             BLOB NOT NULL,
    bytes            INTEGER NOT NULL,          -- the message's size while spooled
    published_at     TEXT,
    published_to     INTEGER
) STRICT;
CREATE INDEX spooled_webhooks_unpublished ON spooled_webhooks (received_at, id) WHERE published_at IS NULL;
CREATE INDEX spooled_webhooks_delivery ON spooled_webhooks (delivery_id);
CREATE INDEX spooled_webhooks_published ON spooled_webhooks (published_at) WHERE published_at IS NOT NULL;
-- migration 23: certificates in the store
-- tls_files: what serving HTTPS by ACME keeps (certmagic's storage): the
-- ACME account, each certificate, its private key and its metadata, by
-- certmagic's key (a path such as "certificates/<ca>/<domain>/<domain>.crt"):
-- on one VPS in the database file, so a backup carries them; on
-- PostgreSQL shared by every node, which all serve the one certificate.
-- tls_locks: certmagic's locks (ordering a certificate is one node's at a
-- time), each held by a node until expires_at, renewed while held.
-- Additive: the floor stays.
CREATE TABLE tls_files (
    key         TEXT PRIMARY KEY,
    value       BLOB NOT NULL,
    modified_at TEXT NOT NULL
) STRICT;
CREATE TABLE tls_locks (
    name       TEXT PRIMARY KEY,
    node       TEXT NOT NULL,
    expires_at TEXT NOT NULL
) STRICT;
-- migration 24: each delivery's trace
-- github.trace_id: the trace (OpenTelemetry, [tracing]) the delivery's
-- message carried, which its story names; NULL untraced. Additive: the
-- floor stays.
ALTER TABLE github ADD COLUMN trace_id TEXT;
-- migration 25: the outbox
-- outbox: every webhook the endpoint accepted, committed here before its
-- 202 and forwarded to the broker after: the message as it will be
-- published (exchange and routing key, its headers as a JSON object of
-- typed AMQP values, the body as compressed). node is the node that
-- forwards it (the one that took it, or the one that adopted it when that
-- node's outbox lease was gone); it forwards its rows in id order, which
-- is commit order. A row confirmed by the broker keeps its times, not its
-- message (body and headers emptied), 7 days for the delivery's story; one
-- the broker refuses for good (over its size) keeps its message and why,
-- refused_at set, until `switchyard outbox retry`. The spool's rows an
-- older version left are moved here and forwarded. Additive: an older node
-- neither reads nor writes it, so the floor stays.
CREATE TABLE outbox (
    id               INTEGER PRIMARY KEY,
    node             TEXT NOT NULL,
    delivery_id      TEXT NOT NULL,
    hook_id          INTEGER,                   -- NULL when none
    event            TEXT NOT NULL,
    received_at      TEXT NOT NULL,             -- at the door
    queued_at        TEXT NOT NULL,             -- committed here
    exchange         TEXT NOT NULL,
    routing_key      TEXT NOT NULL,
    headers          TEXT NOT NULL,
    content_encoding TEXT NOT NULL DEFAULT '',
    body             BLOB,                      -- NULL once published
    bytes            INTEGER NOT NULL,          -- the message's size while it waits
    published_at     TEXT,
    published_to     INTEGER,
    refused_at       TEXT,
    refused          TEXT NOT NULL DEFAULT ''   -- why the broker refused it for good
) STRICT;
CREATE INDEX outbox_waiting ON outbox (node, id) WHERE published_at IS NULL;
CREATE INDEX outbox_delivery ON outbox (delivery_id);
-- migration 26: every hook's ledger
-- delivery_gaps and hook_redeliveries are kept per hook: hook_id is the
-- repository's or organization's webhook whose ledger found the row (its
-- X-GitHub-Hook-ID), 0 for the App's own hook, which every row before
-- this migration is; the same GUID may be a gap of two hooks (GitHub's
-- copies of one event). github_attempts.hook_id likewise. An older node
-- keys these tables by guid alone (ON CONFLICT (guid)), which no longer
-- holds: it refuses the database (floor 26).
-- floor: 26
CREATE TABLE delivery_gaps_by_hook (
    guid             TEXT NOT NULL,
    delivery_id      INTEGER NOT NULL,
    event            TEXT NOT NULL,
    delivered_at     TEXT NOT NULL,
    found_at         TEXT NOT NULL,
    redelivered_at   TEXT,
    resolved_at      TEXT,
    refusals         INTEGER NOT NULL DEFAULT 0,
    unrecoverable_at TEXT,
    last_error       TEXT NOT NULL DEFAULT '',
    hook_id          INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (hook_id, guid)
) STRICT;
INSERT INTO delivery_gaps_by_hook (hook_id, guid, delivery_id, event, delivered_at, found_at, redelivered_at, resolved_at,
        refusals, unrecoverable_at, last_error)
    SELECT 0, guid, delivery_id, event, delivered_at, found_at, redelivered_at, resolved_at, refusals, unrecoverable_at, last_error
    FROM delivery_gaps;
DROP TABLE delivery_gaps;
ALTER TABLE delivery_gaps_by_hook RENAME TO delivery_gaps;
CREATE INDEX delivery_gaps_open ON delivery_gaps (found_at) WHERE resolved_at IS NULL;
CREATE TABLE hook_redeliveries_by_hook (
    guid           TEXT NOT NULL,
    delivery_id    INTEGER NOT NULL,
    event          TEXT NOT NULL DEFAULT '',
    queued_at      TEXT NOT NULL,
    republished_at TEXT,
    hook_id        INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (hook_id, guid)
) STRICT;
INSERT INTO hook_redeliveries_by_hook (hook_id, guid, delivery_id, event, queued_at, republished_at)
    SELECT 0, guid, delivery_id, event, queued_at, republished_at FROM hook_redeliveries;
DROP TABLE hook_redeliveries;
ALTER TABLE hook_redeliveries_by_hook RENAME TO hook_redeliveries;
ALTER TABLE github_attempts ADD COLUMN hook_id INTEGER NOT NULL DEFAULT 0;
CREATE INDEX delivery_gaps_guid ON delivery_gaps (guid);
