package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"
)

// rowMeta is what every typed row carries of the delivery that wrote it.
type rowMeta struct {
	DeliveryID     string
	HookID         any // nullInt
	TargetType     string
	TargetID       any
	InstallationID any
	Now            string
	// ReceivedAt is when the delivery was received: a row last written by
	// a delivery received later is not written over (laterWriter).
	ReceivedAt string
}

func newRowMeta(ev *Event) rowMeta {
	return rowMeta{DeliveryID: ev.DeliveryID, HookID: nullInt(ev.HookID), TargetType: ev.TargetType,
		TargetID: nullInt(ev.TargetID), InstallationID: nullInt(ev.InstallationID), Now: formatTime(time.Now()),
		ReceivedAt: formatTime(ev.ReceivedAt)}
}

// writeTableRows writes everything one Event maps to, inside tx. stale names
// the order-safe table whose row was newer than the Event's object and kept,
// "" when every row was written.
func (tx *Tx) writeTableRows(ctx context.Context, m rowMeta, r *tableRows) (stale string, err error) {
	// done writes a table that is not order-safe: it is never stale.
	done := func(err error) (bool, error) { return false, err }
	issues := "github_issues"
	if r.Issue != nil && r.Issue.Pull {
		issues = "github_pull_requests"
	}
	steps := []struct {
		table string
		skip  bool
		write func() (stale bool, err error)
	}{
		{"github_releases", r.Release == nil, func() (bool, error) { return done(tx.writeRelease(ctx, m, r.Release)) }},
		{"github_release_workflow_runs", r.WorkflowRun == nil, func() (bool, error) { return done(tx.writeWorkflowRun(ctx, m, r.WorkflowRun)) }},
		{"github_branches", r.Branch == nil, func() (bool, error) { return done(tx.writeBranch(ctx, m, r.Branch)) }},
		{issues, r.Issue == nil, func() (bool, error) { return tx.writeIssue(ctx, m, r.Issue) }},
		{"github_comments", r.Comment == nil, func() (bool, error) { return tx.writeComment(ctx, m, r.Comment) }},
		{"github_discussions", r.Discussion == nil, func() (bool, error) { return tx.writeDiscussion(ctx, m, r.Discussion) }},
		{"github_check_runs", r.CheckRun == nil, func() (bool, error) { return tx.writeCheckRun(ctx, m, r.CheckRun) }},
		{"github_pushes", r.Push == nil, func() (bool, error) { return done(tx.writePush(ctx, m, r.Push)) }},
		{"github_installations", r.Installation == nil, func() (bool, error) { return done(tx.writeInstallation(ctx, m, r.Installation)) }},
		{"github_repositories", len(r.Repositories) == 0, func() (bool, error) { return done(tx.writeRepositories(ctx, m, r.Repositories)) }},
	}
	for _, s := range steps {
		if s.skip {
			continue
		}
		old, err := s.write()
		if err != nil {
			return "", fmt.Errorf("write %s: %w", s.table, err)
		}
		if old {
			stale = s.table
		}
	}
	return stale, nil
}

// orderSafeTables are the typed tables whose rows keep github_updated_at and
// are never overwritten by an older object.
var orderSafeTables = []string{"github_issues", "github_pull_requests", "github_comments", "github_discussions", "github_check_runs"}

// newerOrSame is the condition of an order-safe upsert: the
// Event's object is not older than the stored row's. A time that is missing
// on either side cannot say, and a NULL stored time reads as older than
// anything, so both let the Event through.
func newerOrSame(table string) string {
	return "excluded.github_updated_at IS NULL OR " + table + ".github_updated_at IS NULL OR excluded.github_updated_at >= " + table + ".github_updated_at"
}

// differs is the condition under which an upsert's update changes the
// row: one of cols would change. A col is a column the update sets to
// excluded's value, or "column=expression" for one it sets otherwise.
// The columns of when and how (updated_at, processing_date,
// processing_state) are left out: a delivery written again brings nothing
// new (reprocess, another hook's copy of a release) and leaves the row,
// and the work it asks for, as they were; a fixed mapping that writes a
// column otherwise does change it.
func differs(table string, cols ...string) string {
	old := make([]string, len(cols))
	neu := make([]string, len(cols))
	for i, c := range cols {
		name, expr, ok := strings.Cut(c, "=")
		if !ok {
			expr = "excluded." + name
		}
		old[i], neu[i] = table+"."+name, expr
	}
	return "(" + strings.Join(old, ", ") + ") IS DISTINCT FROM (" + strings.Join(neu, ", ") + ")"
}

// laterWriter is the condition that keeps a row a delivery received after
// the Event's wrote: param is the Event's received_at. A history written
// again in received order (reprocess) then never steps a row back to an
// earlier delivery whose object has the same time, nor does a delivery
// that came late through the retry cycle.
func laterWriter(table, param string) string {
	return "NOT EXISTS (SELECT 1 FROM github g WHERE g.delivery_id = " + table + ".delivery_id AND g.received_at > " + param + ")"
}

// upserted reports whether an order-safe upsert left the row as it was: the
// stored row was newer.
func upserted(res sql.Result, err error) (stale bool, _ error) {
	if err != nil {
		return false, err
	}
	n, err := res.RowsAffected()
	return n == 0, err
}

// writeRelease upserts a release unless the stored row is newer.
func (tx *Tx) writeRelease(ctx context.Context, m rowMeta, r *releaseRow) error {
	_, err := tx.write(ctx, ahead(anyRows), `INSERT INTO github_releases (release_id, repository, tag_name, name, draft,
		prerelease, author, html_url, last_action, created_at, published_at, deleted, github_updated_at, delivery_id, updated_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
		ON CONFLICT (release_id) DO UPDATE SET repository = excluded.repository, tag_name = excluded.tag_name,
			name = excluded.name, draft = excluded.draft, prerelease = excluded.prerelease, author = excluded.author,
			html_url = excluded.html_url, last_action = excluded.last_action, created_at = excluded.created_at,
			published_at = excluded.published_at, deleted = excluded.deleted,
			github_updated_at = excluded.github_updated_at, delivery_id = excluded.delivery_id, updated_at = excluded.updated_at
		WHERE excluded.github_updated_at >= github_releases.github_updated_at AND `+releaseChanges,
		r.ID, r.Repository, r.TagName, r.Name, r.Draft, r.Prerelease, r.Author, r.HTMLURL, r.Action,
		r.CreatedAt, r.PublishedAt, r.Deleted, *r.GitHubUpdated, m.DeliveryID, m.Now, m.ReceivedAt)
	return err
}

var releaseChanges = differs("github_releases", "repository", "tag_name", "name", "draft", "prerelease", "author",
	"html_url", "last_action", "created_at", "published_at", "deleted", "github_updated_at", "delivery_id") +
	" AND " + laterWriter("github_releases", "$16")

// writeWorkflowRun upserts a run unless the stored row is newer, linking it
// to its release tag: the head branch of a run triggered by a release, or a
// head branch that is a known release tag of the repository.
func (tx *Tx) writeWorkflowRun(ctx context.Context, m rowMeta, r *workflowRunRow) error {
	var tag any
	if r.EventName == "release" && r.HeadBranch != "" {
		tag = r.HeadBranch
	} else if r.HeadBranch != "" {
		var t string
		err := tx.row(ctx, `SELECT tag_name FROM github_releases WHERE repository = $1 AND tag_name = $2 LIMIT 1`,
			r.Repository, r.HeadBranch).Scan(&t)
		if err != nil && !errors.Is(err, sql.ErrNoRows) {
			return err
		}
		if err == nil {
			tag = t
		}
	}
	_, err := tx.write(ctx, ahead(anyRows), `INSERT INTO github_release_workflow_runs (run_id, repository, workflow_name,
		head_branch, head_sha, event, status, conclusion, run_number, run_attempt, html_url, github_updated_at,
		release_tag, delivery_id, updated_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
		ON CONFLICT (run_id) DO UPDATE SET repository = excluded.repository, workflow_name = excluded.workflow_name,
			head_branch = excluded.head_branch, head_sha = excluded.head_sha, event = excluded.event,
			status = excluded.status, conclusion = excluded.conclusion, run_number = excluded.run_number,
			run_attempt = excluded.run_attempt, html_url = excluded.html_url,
			github_updated_at = excluded.github_updated_at,
			release_tag = coalesce(excluded.release_tag, github_release_workflow_runs.release_tag),
			delivery_id = excluded.delivery_id, updated_at = excluded.updated_at
		WHERE excluded.github_updated_at >= github_release_workflow_runs.github_updated_at AND `+workflowRunChanges,
		r.ID, r.Repository, r.Name, r.HeadBranch, r.HeadSHA, r.EventName, r.Status, r.Conclusion,
		r.RunNumber, r.RunAttempt, r.HTMLURL, r.GitHubUpdated, tag, m.DeliveryID, m.Now, m.ReceivedAt)
	return err
}

var workflowRunChanges = differs("github_release_workflow_runs", "repository", "workflow_name", "head_branch", "head_sha",
	"event", "status", "conclusion", "run_number", "run_attempt", "html_url", "github_updated_at",
	"release_tag=coalesce(excluded.release_tag, github_release_workflow_runs.release_tag)", "delivery_id") +
	" AND " + laterWriter("github_release_workflow_runs", "$16")

func (tx *Tx) writeBranch(ctx context.Context, m rowMeta, r *branchRow) error {
	_, err := tx.write(ctx, ahead(anyRows), `INSERT INTO github_branches (delivery_id, hook_id, target_type, target_id,
		installation_id, event, repository, ref, ref_type, master_branch, sender, processing_state, processing_date,
		created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'NEW', $12, $13, $14)
		ON CONFLICT (delivery_id) DO NOTHING`,
		m.DeliveryID, m.HookID, m.TargetType, m.TargetID, m.InstallationID, r.Event, r.Repository, r.Ref,
		r.RefType, r.MasterBranch, r.Sender, m.Now, m.Now, m.Now)
	return err
}

// issueTransition is the state table for pull requests and issues: the new
// state and processing state for an action on a row in state cur ("" when the
// row is absent), or change = false when the row stays as it is.
func issueTransition(action, cur string) (state, processing string, change bool) {
	switch action {
	case "opened", "reopened":
		if cur == "" {
			return "OPEN", "NEW", true
		}
		return "OPEN", "RE_REQUESTED", true
	case "closed":
		switch cur {
		case "":
			return "CLOSED", "NEW", true
		case "OPEN":
			return "CLOSED", "UPDATED", true
		}
		return "", "", false
	default: // synchronize, edited, ready_for_review, converted_to_draft, labeled, unlabeled
		switch cur {
		case "":
			return "OPEN", "NEW", true
		case "OPEN":
			return "OPEN", "UPDATED", true
		}
		return "", "", false
	}
}

// writeIssue applies an issue's or pull request's action to its row (see
// issueTransition), unless the row is newer than the Event's object: a late
// synchronize never reopens a closed pull request. It reports that as stale.
// One upsert does it: the row's current state picks the transition's result
// in SQL, from both results issueTransition gives for a row that exists, so
// the common case (a new row, or one that changes) is one statement.
func (tx *Tx) writeIssue(ctx context.Context, m rowMeta, r *issueRow) (stale bool, err error) {
	table, query := "github_issues", issueUpsert
	if r.Pull {
		table, query = "github_pull_requests", pullUpsert
	}
	state, processing, _ := issueTransition(r.Action, "")
	openState, openProcessing, openChange := issueTransition(r.Action, "OPEN")
	closedState, closedProcessing, closedChange := issueTransition(r.Action, "CLOSED")
	args := []any{m.DeliveryID, m.HookID, m.TargetType, m.TargetID, m.InstallationID, r.Owner, r.Name, r.Number,
		r.Title, r.Sender, state, r.Action, processing, m.Now, m.Now, r.Updated}
	if r.Pull {
		args = append(args, r.HeadRef, r.HeadSHA, r.Merged, r.Draft)
	}
	args = append(args, r.NodeID, m.Now, openState, closedState, openProcessing, closedProcessing, openChange, closedChange, m.ReceivedAt)
	res, err := tx.write(ctx, guessed(&tx.s.guesses.row), query, args...)
	if err != nil {
		return false, err
	}
	if n, err := res.RowsAffected(); err != nil || n > 0 {
		return false, err
	}
	// The row stayed as it was: it is newer than the Event's object
	// (stale), or the action does not change a row in its state.
	if r.Updated == nil {
		return false, nil
	}
	var updated sql.NullString
	err = tx.row(ctx, "SELECT github_updated_at FROM "+table+" WHERE node_id = $1", r.NodeID).Scan(&updated)
	if err != nil {
		return false, err
	}
	return updated.Valid && *r.Updated < updated.String, nil
}

// issueUpsert and pullUpsert are writeIssue's statements: the row's
// columns, node_id and created_at, then the state and processing state for a
// row found OPEN and for one found CLOSED, and whether each changes.
var issueUpsert, pullUpsert = issueUpsertFor("github_issues", nil), issueUpsertFor("github_pull_requests",
	[]string{"head_ref", "head_sha", "merged", "draft"})

func issueUpsertFor(table string, extra []string) string {
	cols := append([]string{"delivery_id", "hook_id", "target_type", "target_id", "installation_id",
		"repository_owner", "repository_name", "number", "title", "sender", "state", "last_action",
		"processing_state", "processing_date", "updated_at", "github_updated_at"}, extra...)
	var set, data []string
	for _, c := range cols {
		switch c {
		case "state":
			set = append(set, "state = CASE "+table+".state WHEN 'OPEN' THEN ? ELSE ? END")
		case "processing_state":
			set = append(set, "processing_state = CASE "+table+".state WHEN 'OPEN' THEN ? ELSE ? END")
		case "github_updated_at":
			// An Event without the time keeps the row's.
			keep := "github_updated_at=coalesce(excluded.github_updated_at, " + table + ".github_updated_at)"
			set, data = append(set, strings.Replace(keep, "=", " = ", 1)), append(data, keep)
		case "processing_date", "updated_at":
			set = append(set, c+" = excluded."+c)
		default:
			set, data = append(set, c+" = excluded."+c), append(data, c)
		}
	}
	return numberParams("INSERT INTO " + table + " (" + strings.Join(cols, ", ") + ", node_id, created_at) VALUES (?" +
		strings.Repeat(", ?", len(cols)+1) + ") ON CONFLICT (node_id) DO UPDATE SET " + strings.Join(set, ", ") +
		" WHERE (" + newerOrSame(table) + ") AND CASE " + table + ".state WHEN 'OPEN' THEN CAST(? AS INTEGER) ELSE CAST(? AS INTEGER) END = 1" +
		" AND " + differs(table, data...) + " AND " + laterWriter(table, "?"))
}

func (tx *Tx) writeComment(ctx context.Context, m rowMeta, r *commentRow) (stale bool, err error) {
	return upserted(tx.write(ctx, guessed(&tx.s.guesses.row), `INSERT INTO github_comments (comment_id, delivery_id, hook_id, target_type,
		target_id, installation_id, event, repository, number, commit_id, path, author, body, html_url, deleted,
		last_action, processing_state, processing_date, created_at, updated_at, github_updated_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, 'NEW', $17, $18, $19, $20)
		ON CONFLICT (comment_id) DO UPDATE SET delivery_id = excluded.delivery_id, hook_id = excluded.hook_id,
			target_type = excluded.target_type, target_id = excluded.target_id,
			installation_id = excluded.installation_id, body = excluded.body, html_url = excluded.html_url,
			deleted = excluded.deleted, last_action = excluded.last_action, processing_state = $21,
			processing_date = excluded.processing_date, updated_at = excluded.updated_at,
			github_updated_at = coalesce(excluded.github_updated_at, github_comments.github_updated_at)
		WHERE (`+newerOrSame("github_comments")+") AND "+commentChanges,
		r.ID, m.DeliveryID, m.HookID, m.TargetType, m.TargetID, m.InstallationID, r.Event, r.Repository, r.Number,
		r.CommitID, r.Path, r.Author, r.Body, r.HTMLURL, r.Action == "deleted", r.Action, m.Now, m.Now, m.Now,
		r.Updated, entityState(r.Action), m.ReceivedAt))
}

var commentChanges = differs("github_comments", "delivery_id", "hook_id", "target_type", "target_id", "installation_id",
	"body", "html_url", "deleted", "last_action",
	"github_updated_at=coalesce(excluded.github_updated_at, github_comments.github_updated_at)") +
	" AND " + laterWriter("github_comments", "$22")

func (tx *Tx) writeDiscussion(ctx context.Context, m rowMeta, r *discussionRow) (stale bool, err error) {
	// A comment is an update of its discussion, never a repeated creation.
	state := entityState(r.Action)
	if r.Event == "discussion_comment" {
		state = "UPDATED"
	}
	return upserted(tx.write(ctx, guessed(&tx.s.guesses.row), `INSERT INTO github_discussions (node_id, delivery_id, hook_id, target_type,
		target_id, installation_id, repository, number, title, category, state, sender, last_event, last_action,
		last_comment_id, processing_state, processing_date, created_at, updated_at, github_updated_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, 'NEW', $16, $17, $18, $19)
		ON CONFLICT (node_id) DO UPDATE SET delivery_id = excluded.delivery_id, hook_id = excluded.hook_id,
			target_type = excluded.target_type, target_id = excluded.target_id,
			installation_id = excluded.installation_id, repository = excluded.repository, title = excluded.title,
			category = excluded.category, state = excluded.state, sender = excluded.sender,
			last_event = excluded.last_event, last_action = excluded.last_action,
			last_comment_id = coalesce(excluded.last_comment_id, github_discussions.last_comment_id),
			processing_state = $20, processing_date = excluded.processing_date, updated_at = excluded.updated_at,
			github_updated_at = coalesce(excluded.github_updated_at, github_discussions.github_updated_at)
		WHERE (`+newerOrSame("github_discussions")+") AND "+discussionChanges,
		r.NodeID, m.DeliveryID, m.HookID, m.TargetType, m.TargetID, m.InstallationID, r.Repository, r.Number,
		r.Title, r.Category, r.State, r.Sender, r.Event, r.Action, r.CommentID, m.Now, m.Now, m.Now, r.Updated, state, m.ReceivedAt))
}

var discussionChanges = differs("github_discussions", "delivery_id", "hook_id", "target_type", "target_id",
	"installation_id", "repository", "title", "category", "state", "sender", "last_event", "last_action",
	"last_comment_id=coalesce(excluded.last_comment_id, github_discussions.last_comment_id)",
	"github_updated_at=coalesce(excluded.github_updated_at, github_discussions.github_updated_at)") +
	" AND " + laterWriter("github_discussions", "$21")

func (tx *Tx) writeCheckRun(ctx context.Context, m rowMeta, r *checkRunRow) (stale bool, err error) {
	return upserted(tx.write(ctx, guessed(&tx.s.guesses.row), `INSERT INTO github_check_runs (check_run_id, delivery_id, hook_id, target_type,
		target_id, installation_id, repository, name, head_sha, status, conclusion, html_url, requested_action,
		last_action, processing_state, processing_date, created_at, updated_at, github_updated_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, 'NEW', $15, $16, $17, $18)
		ON CONFLICT (check_run_id) DO UPDATE SET delivery_id = excluded.delivery_id, hook_id = excluded.hook_id,
			target_type = excluded.target_type, target_id = excluded.target_id,
			installation_id = excluded.installation_id, name = excluded.name, head_sha = excluded.head_sha,
			status = excluded.status, conclusion = excluded.conclusion, html_url = excluded.html_url,
			requested_action = excluded.requested_action, last_action = excluded.last_action,
			processing_state = $19, processing_date = excluded.processing_date, updated_at = excluded.updated_at,
			github_updated_at = coalesce(excluded.github_updated_at, github_check_runs.github_updated_at)
		WHERE (`+newerOrSame("github_check_runs")+") AND "+checkRunChanges,
		r.ID, m.DeliveryID, m.HookID, m.TargetType, m.TargetID, m.InstallationID, r.Repository, r.Name, r.HeadSHA,
		r.Status, r.Conclusion, r.HTMLURL, r.RequestedAction, r.Action, m.Now, m.Now, m.Now, r.Updated, entityState(r.Action),
		m.ReceivedAt))
}

var checkRunChanges = differs("github_check_runs", "delivery_id", "hook_id", "target_type", "target_id",
	"installation_id", "name", "head_sha", "status", "conclusion", "html_url", "requested_action", "last_action",
	"github_updated_at=coalesce(excluded.github_updated_at, github_check_runs.github_updated_at)") +
	" AND " + laterWriter("github_check_runs", "$20")

// writePush inserts a push; the same head pushed again asks for the work
// again (RE_REQUESTED).
func (tx *Tx) writePush(ctx context.Context, m rowMeta, r *pushRow) error {
	_, err := tx.write(ctx, ahead(anyRows), `INSERT INTO github_pushes (delivery_id, hook_id, target_type, target_id,
		installation_id, repository, head_commit, ref, before, pusher, commits, created, deleted, forced,
		processing_state, processing_date, created_at, updated_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, 'NEW', $15, $16, $17)
		ON CONFLICT (repository, head_commit) DO UPDATE SET delivery_id = excluded.delivery_id,
			hook_id = excluded.hook_id, target_type = excluded.target_type, target_id = excluded.target_id,
			installation_id = excluded.installation_id, ref = excluded.ref, before = excluded.before,
			pusher = excluded.pusher, commits = excluded.commits, created = excluded.created,
			deleted = excluded.deleted, forced = excluded.forced, processing_state = 'RE_REQUESTED',
			processing_date = excluded.processing_date, updated_at = excluded.updated_at
		WHERE `+pushChanges,
		m.DeliveryID, m.HookID, m.TargetType, m.TargetID, m.InstallationID, r.Repository, r.HeadCommit, r.Ref,
		r.Before, r.Pusher, r.Commits, r.Created, r.Deleted, r.Forced, m.Now, m.Now, m.Now, m.ReceivedAt)
	return err
}

var pushChanges = differs("github_pushes", "delivery_id", "hook_id", "target_type", "target_id", "installation_id",
	"ref", "before", "pusher", "commits", "created", "deleted", "forced") + " AND " + laterWriter("github_pushes", "$18")

func (tx *Tx) writeInstallation(ctx context.Context, m rowMeta, r *installationRow) error {
	state := entityState(r.Action)
	if r.Event == "installation_repositories" {
		state = "UPDATED"
	}
	_, err := tx.write(ctx, ahead(anyRows), `INSERT INTO github_installations (installation_id, delivery_id, hook_id,
		target_type, target_id, account, account_type, repository_selection, app_id, suspended, deleted,
		last_event, last_action, processing_state, processing_date, created_at, updated_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, 'NEW', $14, $15, $16)
		ON CONFLICT (installation_id) DO UPDATE SET delivery_id = excluded.delivery_id, hook_id = excluded.hook_id,
			target_type = excluded.target_type, target_id = excluded.target_id,
			account = coalesce(nullif(excluded.account, ''), github_installations.account),
			account_type = coalesce(nullif(excluded.account_type, ''), github_installations.account_type),
			repository_selection = coalesce(nullif(excluded.repository_selection, ''), github_installations.repository_selection),
			app_id = coalesce(excluded.app_id, github_installations.app_id),
			suspended = excluded.suspended, deleted = excluded.deleted, last_event = excluded.last_event,
			last_action = excluded.last_action, processing_state = $17, processing_date = excluded.processing_date,
			updated_at = excluded.updated_at
		WHERE `+installationChanges,
		r.ID, m.DeliveryID, m.HookID, m.TargetType, m.TargetID, r.Account, r.AccountType, r.RepositorySelection,
		nullInt(r.AppID), r.Suspended, r.Deleted, r.Event, r.Action, m.Now, m.Now, m.Now, state, m.ReceivedAt)
	return err
}

var installationChanges = differs("github_installations", "delivery_id", "hook_id", "target_type", "target_id",
	"account=coalesce(nullif(excluded.account, ''), github_installations.account)",
	"account_type=coalesce(nullif(excluded.account_type, ''), github_installations.account_type)",
	"repository_selection=coalesce(nullif(excluded.repository_selection, ''), github_installations.repository_selection)",
	"app_id=coalesce(excluded.app_id, github_installations.app_id)",
	"suspended", "deleted", "last_event", "last_action") + " AND " + laterWriter("github_installations", "$18")

func (tx *Tx) writeRepositories(ctx context.Context, m rowMeta, rs []repositoryRow) error {
	for _, r := range rs {
		_, err := tx.write(ctx, ahead(anyRows), `INSERT INTO github_repositories (delivery_id, hook_id, target_type, target_id,
			installation_id, event, action, repository, repository_id, private, sender, processing_state,
			processing_date, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'NEW', $12, $13, $14)
			ON CONFLICT (delivery_id, repository) DO NOTHING`,
			m.DeliveryID, m.HookID, m.TargetType, m.TargetID, m.InstallationID, r.Event, r.Action, r.Repository,
			nullInt(r.RepositoryID), r.Private, r.Sender, m.Now, m.Now, m.Now)
		if err != nil {
			return err
		}
	}
	return nil
}
