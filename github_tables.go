package main

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"
)

// This file maps Events to the rows of the release-tracking and typed bot
// tables: it names the fields the tables read of each Event's
// payload (newTablePayload), which DecodeEvent decodes with the Event, and
// says which rows an Event writes. store_tables.go writes them.

// isBotEvent reports whether the Event was delivered to the bot App's hook:
// the typed tables are filled for those only.
func isBotEvent(ev *Event, botAppID int64) bool {
	return botAppID > 0 && ev.TargetType == "integration" && ev.TargetID == botAppID
}

// tableRows is what one Event writes; any field may be nil.
type tableRows struct {
	Release       *releaseRow
	WorkflowRun   *workflowRunRow
	Branch        *branchRow
	Issue         *issueRow // issues and pull requests alike
	Comment       *commentRow
	Discussion    *discussionRow
	CheckRun      *checkRunRow
	Push          *pushRow
	Installation  *installationRow
	Repositories  []repositoryRow
	SkippedReason string // set when the Event is for a bot table but its action is not used
}

func (r *tableRows) empty() bool {
	return r.Release == nil && r.WorkflowRun == nil && r.Branch == nil && r.Issue == nil && r.Comment == nil &&
		r.Discussion == nil && r.CheckRun == nil && r.Push == nil && r.Installation == nil && len(r.Repositories) == 0
}

// Payload pieces shared by several Events.
type (
	jsonUser struct {
		Login string `json:"login"`
	}
	jsonRepo struct {
		ID       int64  `json:"id"`
		FullName string `json:"full_name"`
		Name     string `json:"name"`
		Private  *bool  `json:"private"`
		Owner    *struct {
			Login string `json:"login"`
		} `json:"owner"`
	}
)

// repoParts splits the repository into owner and name, requiring both.
func repoParts(event string, r *jsonRepo) (owner, name string, err error) {
	if r == nil || r.FullName == "" {
		return "", "", malformed("%s: payload has no repository.full_name", event)
	}
	owner, name, ok := strings.Cut(r.FullName, "/")
	if !ok || owner == "" || name == "" {
		return "", "", malformed("%s: repository.full_name %q is not owner/name", event, r.FullName)
	}
	return owner, name, nil
}

func login(u *jsonUser) string {
	if u == nil {
		return ""
	}
	return u.Login
}

// tableDecoder is what the tables take of the Events of one name: the
// payload type its decoder reads, which DecodeEvent decodes the payload into
// (each embeds eventPayload, so that one pass decodes what the Event and its
// rows read), and the decoder, which fills rows. Release tracking reads
// every repository's Events (everyApp), the typed tables the bot App's only.
type tableDecoder struct {
	everyApp bool
	payload  func() tablePayload
	decode   func(ev *Event, rows *tableRows) error
}

// tableDecoders are the tableDecoder of each Event name the tables read.
var tableDecoders = func() map[string]tableDecoder {
	m := map[string]tableDecoder{}
	add := func(d tableDecoder, names ...string) {
		for _, n := range names {
			m[n] = d
		}
	}
	add(tableDecoder{everyApp: true, payload: func() tablePayload { return new(releasePayload) },
		decode: func(ev *Event, r *tableRows) (err error) { r.Release, err = decodeRelease(ev); return err }}, "release")
	add(tableDecoder{everyApp: true, payload: func() tablePayload { return new(workflowRunPayload) },
		decode: func(ev *Event, r *tableRows) (err error) { r.WorkflowRun, err = decodeWorkflowRun(ev); return err }}, "workflow_run")
	add(tableDecoder{payload: func() tablePayload { return new(branchPayload) },
		decode: func(ev *Event, r *tableRows) (err error) { r.Branch, err = decodeBranch(ev); return err }}, "create", "delete")
	add(tableDecoder{payload: func() tablePayload { return new(issuePayload) },
		decode: func(ev *Event, r *tableRows) (err error) { r.Issue, err = decodeIssue(ev); return err }}, "issues")
	add(tableDecoder{payload: func() tablePayload { return new(pullRequestPayload) },
		decode: func(ev *Event, r *tableRows) (err error) { r.Issue, err = decodePullRequest(ev); return err }}, "pull_request")
	add(tableDecoder{payload: func() tablePayload { return new(commentPayload) },
		decode: func(ev *Event, r *tableRows) (err error) { r.Comment, err = decodeComment(ev); return err }},
		"issue_comment", "pull_request_review_comment", "commit_comment")
	add(tableDecoder{payload: func() tablePayload { return new(discussionPayload) },
		decode: func(ev *Event, r *tableRows) (err error) { r.Discussion, err = decodeDiscussion(ev); return err }},
		"discussion", "discussion_comment")
	add(tableDecoder{payload: func() tablePayload { return new(checkRunPayload) },
		decode: func(ev *Event, r *tableRows) (err error) { r.CheckRun, err = decodeCheckRun(ev); return err }}, "check_run")
	add(tableDecoder{payload: func() tablePayload { return new(pushPayload) },
		decode: func(ev *Event, r *tableRows) (err error) { r.Push, err = decodePush(ev); return err }}, "push")
	add(tableDecoder{payload: func() tablePayload { return new(installationPayload) },
		decode: func(ev *Event, r *tableRows) (err error) {
			r.Installation, r.Repositories, err = decodeInstallation(ev)
			return err
		}}, "installation", "installation_repositories")
	add(tableDecoder{payload: func() tablePayload { return new(repositoryPayload) },
		decode: func(ev *Event, r *tableRows) error {
			repo, err := decodeRepository(ev)
			r.Repositories = []repositoryRow{repo}
			return err
		}}, "repository")
	return m
}()

// newTablePayload is the payload type the tables read of an Event name
// (tableDecoders), an eventPayload alone for a name they do not read.
func newTablePayload(name string) tablePayload {
	if d, ok := tableDecoders[name]; ok {
		return d.payload()
	}
	return new(eventPayload)
}

// decodeInto is the Event's payload as T: the one DecodeEvent decoded, or,
// for an Event built by hand or of another name, the payload decoded now. A
// payload that does not fit the Event's shape is a permanent failure.
func decodeInto[T any](ev *Event) (*T, error) {
	p, ok := any(ev.decoded).(*T)
	err := ev.shapeErr
	if !ok {
		p = new(T)
		err = decodeJSON(ev.Payload, p)
	}
	if err != nil {
		return nil, malformed("%s: payload does not have the %s shape: %v", ev.Name, ev.Name, err)
	}
	return p, nil
}

// Actions that change the typed rows. Others are acked and logged at debug.
var (
	issueActions = []string{"opened", "reopened", "closed", "edited", "labeled", "unlabeled"}
	pullActions  = []string{"opened", "reopened", "closed", "edited", "labeled", "unlabeled",
		"synchronize", "ready_for_review", "converted_to_draft"}
	commentActions    = []string{"created", "edited", "deleted"}
	discussionActions = []string{"created", "edited", "deleted", "answered", "unanswered", "category_changed",
		"labeled", "unlabeled", "locked", "unlocked", "pinned", "unpinned", "transferred", "closed", "reopened"}
	checkRunActions     = []string{"created", "rerequested", "requested_action", "completed"}
	installationActions = []string{"created", "deleted", "suspend", "unsuspend", "new_permissions_accepted"}
)

// creationActions are the actions that ask for a row's work again when the
// row exists: a repeated creation is RE_REQUESTED, anything else UPDATED.
var creationActions = []string{"created", "opened", "reopened", "rerequested", "requested_action"}

// entityState is the processing state for an existing row of the tables
// without a state table of their own.
func entityState(action string) string {
	if slices.Contains(creationActions, action) {
		return "RE_REQUESTED"
	}
	return "UPDATED"
}

// decodeTableRows decodes what ev writes: release tracking for every
// repository, then the typed tables for the bot App's Events.
func decodeTableRows(ev *Event, botAppID int64) (*tableRows, error) {
	rows := &tableRows{}
	bot := isBotEvent(ev, botAppID)
	if d, ok := tableDecoders[ev.Name]; ok && (d.everyApp || bot) {
		if err := d.decode(ev, rows); err != nil || !bot {
			return rows, err
		}
	}
	if bot && rows.empty() {
		rows.SkippedReason = fmt.Sprintf("no typed table uses %s.%s", ev.Name, ev.Action)
	}
	return rows, nil
}

// releaseRow is one github_releases row.
type releaseRow struct {
	ID                                    int64
	Repository, TagName, Name, Author     string
	HTMLURL, Action                       string
	Draft, Prerelease, Deleted            bool
	CreatedAt, PublishedAt, GitHubUpdated *string
}

// releasePayload is what decodeRelease reads of a payload.
type releasePayload struct {
	eventPayload
	Release *struct {
		ID          int64     `json:"id"`
		TagName     string    `json:"tag_name"`
		Name        *string   `json:"name"`
		Draft       bool      `json:"draft"`
		Prerelease  bool      `json:"prerelease"`
		Author      *jsonUser `json:"author"`
		HTMLURL     string    `json:"html_url"`
		CreatedAt   *string   `json:"created_at"`
		PublishedAt *string   `json:"published_at"`
		UpdatedAt   *string   `json:"updated_at"`
	} `json:"release"`
}

func decodeRelease(ev *Event) (*releaseRow, error) {
	p, err := decodeInto[releasePayload](ev)
	if err != nil {
		return nil, err
	}
	if p.Release == nil || p.Release.ID == 0 || p.Release.TagName == "" {
		return nil, malformed("release: payload has no release.id or release.tag_name")
	}
	if _, _, err := repoParts(ev.Name, p.Repository); err != nil {
		return nil, err
	}
	r := p.Release
	row := &releaseRow{ID: r.ID, Repository: p.Repository.FullName, TagName: r.TagName, Author: login(r.Author),
		HTMLURL: r.HTMLURL, Action: p.Action, Draft: r.Draft, Prerelease: r.Prerelease, Deleted: p.Action == "deleted",
		CreatedAt: normalizedPtr(r.CreatedAt), PublishedAt: normalizedPtr(r.PublishedAt)}
	if r.Name != nil {
		row.Name = *r.Name
	}
	// Release payloads carry no updated_at today; the time the Event was
	// received orders them then.
	row.GitHubUpdated = normalizedPtr(r.UpdatedAt)
	if row.GitHubUpdated == nil {
		t := formatTime(ev.ReceivedAt)
		row.GitHubUpdated = &t
	}
	return row, nil
}

// timeFormat is how every time is stored, and how typed rows carry the
// payload's times: RFC 3339 in UTC with a fixed six fraction digits, so that
// text order is time order (GitHub's own times, with no fraction, would
// otherwise sort after the same second with one).
const timeFormat = "2006-01-02T15:04:05.000000Z"

func formatTime(t time.Time) string { return t.UTC().Format(timeFormat) }

// normalizeTime rewrites an RFC 3339 time from a payload in timeFormat; ok is
// false when s is not one.
func normalizeTime(s string) (string, bool) {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return "", false
	}
	return formatTime(t), true
}

// normalizedPtr rewrites a payload time in timeFormat; nil or unparsable is nil.
func normalizedPtr(s *string) *string {
	if s == nil {
		return nil
	}
	if t, ok := normalizeTime(*s); ok {
		return &t
	}
	return nil
}

// workflowRunRow is one github_release_workflow_runs row.
type workflowRunRow struct {
	ID                                               int64
	Repository, Name, HeadBranch, HeadSHA, EventName string
	Status, Conclusion, HTMLURL, GitHubUpdated       string
	RunNumber, RunAttempt                            int64
}

// workflowRunPayload is what decodeWorkflowRun reads of a payload.
type workflowRunPayload struct {
	eventPayload
	WorkflowRun *struct {
		ID         int64   `json:"id"`
		Name       string  `json:"name"`
		HeadBranch *string `json:"head_branch"`
		HeadSHA    string  `json:"head_sha"`
		Event      string  `json:"event"`
		Status     string  `json:"status"`
		Conclusion *string `json:"conclusion"`
		RunNumber  int64   `json:"run_number"`
		RunAttempt int64   `json:"run_attempt"`
		HTMLURL    string  `json:"html_url"`
		UpdatedAt  string  `json:"updated_at"`
	} `json:"workflow_run"`
}

func decodeWorkflowRun(ev *Event) (*workflowRunRow, error) {
	p, err := decodeInto[workflowRunPayload](ev)
	if err != nil {
		return nil, err
	}
	w := p.WorkflowRun
	if w == nil || w.ID == 0 {
		return nil, malformed("workflow_run: payload has no workflow_run.id")
	}
	updated, ok := normalizeTime(w.UpdatedAt)
	if !ok {
		return nil, malformed("workflow_run: workflow_run.updated_at %q is not a time", w.UpdatedAt)
	}
	if _, _, err := repoParts(ev.Name, p.Repository); err != nil {
		return nil, err
	}
	row := &workflowRunRow{ID: w.ID, Repository: p.Repository.FullName, Name: w.Name, HeadSHA: w.HeadSHA,
		EventName: w.Event, Status: w.Status, HTMLURL: w.HTMLURL, GitHubUpdated: updated,
		RunNumber: w.RunNumber, RunAttempt: w.RunAttempt}
	if w.HeadBranch != nil {
		row.HeadBranch = *w.HeadBranch
	}
	if w.Conclusion != nil {
		row.Conclusion = *w.Conclusion
	}
	return row, nil
}

// branchRow is one github_branches row.
type branchRow struct {
	Event, Repository, Ref, RefType, MasterBranch, Sender string
}

// branchPayload is what decodeBranch reads of a payload.
type branchPayload struct {
	eventPayload
	Ref          string `json:"ref"`
	RefType      string `json:"ref_type"`
	MasterBranch string `json:"master_branch"`
}

func decodeBranch(ev *Event) (*branchRow, error) {
	p, err := decodeInto[branchPayload](ev)
	if err != nil {
		return nil, err
	}
	if p.Ref == "" || p.RefType == "" {
		return nil, malformed("%s: payload has no ref or ref_type", ev.Name)
	}
	if _, _, err := repoParts(ev.Name, p.Repository); err != nil {
		return nil, err
	}
	return &branchRow{Event: ev.Name, Repository: p.Repository.FullName, Ref: p.Ref, RefType: p.RefType,
		MasterBranch: p.MasterBranch, Sender: login(p.Sender)}, nil
}

// issueRow is one github_issues or github_pull_requests row.
type issueRow struct {
	Pull                  bool
	NodeID, Owner, Name   string
	Number                int64
	Title, Sender, Action string
	State                 string // of the payload: OPEN or CLOSED
	HeadRef, HeadSHA      string
	Merged, Draft         bool
	Updated               *string // the object's updated_at, in timeFormat; nil when absent
}

// issuePayload is what decodeIssue reads of a payload.
type issuePayload struct {
	eventPayload
	Issue *struct {
		NodeID    string  `json:"node_id"`
		Number    int64   `json:"number"`
		Title     string  `json:"title"`
		State     string  `json:"state"`
		UpdatedAt *string `json:"updated_at"`
	} `json:"issue"`
}

func decodeIssue(ev *Event) (*issueRow, error) {
	if !slices.Contains(issueActions, ev.Action) {
		return nil, nil
	}
	p, err := decodeInto[issuePayload](ev)
	if err != nil {
		return nil, err
	}
	if p.Issue == nil || p.Issue.NodeID == "" || p.Issue.Number == 0 {
		return nil, malformed("issues: payload has no issue.node_id or issue.number")
	}
	owner, name, err := repoParts(ev.Name, p.Repository)
	if err != nil {
		return nil, err
	}
	return &issueRow{NodeID: p.Issue.NodeID, Owner: owner, Name: name, Number: p.Issue.Number, Title: p.Issue.Title,
		Sender: login(p.Sender), Action: ev.Action, State: strings.ToUpper(p.Issue.State),
		Updated: normalizedPtr(p.Issue.UpdatedAt)}, nil
}

// pullRequestPayload is what decodePullRequest reads of a payload.
type pullRequestPayload struct {
	eventPayload
	PullRequest *struct {
		NodeID    string  `json:"node_id"`
		Number    int64   `json:"number"`
		Title     string  `json:"title"`
		State     string  `json:"state"`
		Merged    bool    `json:"merged"`
		Draft     bool    `json:"draft"`
		UpdatedAt *string `json:"updated_at"`
		Head      *struct {
			Ref string `json:"ref"`
			SHA string `json:"sha"`
		} `json:"head"`
	} `json:"pull_request"`
}

func decodePullRequest(ev *Event) (*issueRow, error) {
	if !slices.Contains(pullActions, ev.Action) {
		return nil, nil
	}
	p, err := decodeInto[pullRequestPayload](ev)
	if err != nil {
		return nil, err
	}
	pr := p.PullRequest
	if pr == nil || pr.NodeID == "" || pr.Number == 0 || pr.Head == nil || pr.Head.SHA == "" {
		return nil, malformed("pull_request: payload has no pull_request.node_id, number or head.sha")
	}
	owner, name, err := repoParts(ev.Name, p.Repository)
	if err != nil {
		return nil, err
	}
	return &issueRow{Pull: true, NodeID: pr.NodeID, Owner: owner, Name: name, Number: pr.Number, Title: pr.Title,
		Sender: login(p.Sender), Action: ev.Action, State: strings.ToUpper(pr.State), HeadRef: pr.Head.Ref,
		HeadSHA: pr.Head.SHA, Merged: pr.Merged, Draft: pr.Draft, Updated: normalizedPtr(pr.UpdatedAt)}, nil
}

// commentRow is one github_comments row.
type commentRow struct {
	ID                                    int64
	Event, Action, Repository             string
	Number                                *int64
	CommitID, Path, Author, Body, HTMLURL string
	Updated                               *string // comment.updated_at
}

// commentPayload is what decodeComment reads of a payload.
type commentPayload struct {
	eventPayload
	Comment *struct {
		ID        int64     `json:"id"`
		CommitID  string    `json:"commit_id"`
		Path      *string   `json:"path"`
		User      *jsonUser `json:"user"`
		Body      string    `json:"body"`
		HTMLURL   string    `json:"html_url"`
		UpdatedAt *string   `json:"updated_at"`
	} `json:"comment"`
	Issue *struct {
		Number int64 `json:"number"`
	} `json:"issue"`
	PullRequest *struct {
		Number int64 `json:"number"`
	} `json:"pull_request"`
}

func decodeComment(ev *Event) (*commentRow, error) {
	if !slices.Contains(commentActions, ev.Action) {
		return nil, nil
	}
	p, err := decodeInto[commentPayload](ev)
	if err != nil {
		return nil, err
	}
	c := p.Comment
	if c == nil || c.ID == 0 {
		return nil, malformed("%s: payload has no comment.id", ev.Name)
	}
	if _, _, err := repoParts(ev.Name, p.Repository); err != nil {
		return nil, err
	}
	row := &commentRow{ID: c.ID, Event: ev.Name, Action: ev.Action, Repository: p.Repository.FullName,
		CommitID: c.CommitID, Author: login(c.User), Body: c.Body, HTMLURL: c.HTMLURL, Updated: normalizedPtr(c.UpdatedAt)}
	if c.Path != nil {
		row.Path = *c.Path
	}
	switch {
	case p.Issue != nil:
		row.Number = &p.Issue.Number
	case p.PullRequest != nil:
		row.Number = &p.PullRequest.Number
	}
	return row, nil
}

// discussionRow is one github_discussions row.
type discussionRow struct {
	NodeID, Repository, Title, Category, State, Sender string
	Number                                             int64
	Event, Action                                      string
	CommentID                                          *int64
	Updated                                            *string // discussion.updated_at
}

// discussionPayload is what decodeDiscussion reads of a payload.
type discussionPayload struct {
	eventPayload
	Discussion *struct {
		NodeID    string  `json:"node_id"`
		Number    int64   `json:"number"`
		Title     string  `json:"title"`
		State     string  `json:"state"`
		UpdatedAt *string `json:"updated_at"`
		Category  *struct {
			Name string `json:"name"`
		} `json:"category"`
	} `json:"discussion"`
	Comment *struct {
		ID int64 `json:"id"`
	} `json:"comment"`
}

func decodeDiscussion(ev *Event) (*discussionRow, error) {
	actions := discussionActions
	if ev.Name == "discussion_comment" {
		actions = commentActions
	}
	if !slices.Contains(actions, ev.Action) {
		return nil, nil
	}
	p, err := decodeInto[discussionPayload](ev)
	if err != nil {
		return nil, err
	}
	d := p.Discussion
	if d == nil || d.NodeID == "" || d.Number == 0 {
		return nil, malformed("%s: payload has no discussion.node_id or discussion.number", ev.Name)
	}
	if ev.Name == "discussion_comment" && (p.Comment == nil || p.Comment.ID == 0) {
		return nil, malformed("discussion_comment: payload has no comment.id")
	}
	if _, _, err := repoParts(ev.Name, p.Repository); err != nil {
		return nil, err
	}
	row := &discussionRow{NodeID: d.NodeID, Repository: p.Repository.FullName, Title: d.Title, State: d.State,
		Sender: login(p.Sender), Number: d.Number, Event: ev.Name, Action: ev.Action, Updated: normalizedPtr(d.UpdatedAt)}
	if d.Category != nil {
		row.Category = d.Category.Name
	}
	if p.Comment != nil {
		row.CommentID = &p.Comment.ID
	}
	return row, nil
}

// checkRunRow is one github_check_runs row.
type checkRunRow struct {
	ID                                            int64
	Repository, Name, HeadSHA, Status, Conclusion string
	HTMLURL, RequestedAction, Action              string
	Updated                                       *string // completed_at, else started_at: a check run has no updated_at
}

// checkRunPayload is what decodeCheckRun reads of a payload.
type checkRunPayload struct {
	eventPayload
	CheckRun *struct {
		ID          int64   `json:"id"`
		Name        string  `json:"name"`
		HeadSHA     string  `json:"head_sha"`
		Status      string  `json:"status"`
		Conclusion  *string `json:"conclusion"`
		HTMLURL     string  `json:"html_url"`
		StartedAt   *string `json:"started_at"`
		CompletedAt *string `json:"completed_at"`
	} `json:"check_run"`
	RequestedAction *struct {
		Identifier string `json:"identifier"`
	} `json:"requested_action"`
}

func decodeCheckRun(ev *Event) (*checkRunRow, error) {
	if !slices.Contains(checkRunActions, ev.Action) {
		return nil, nil
	}
	p, err := decodeInto[checkRunPayload](ev)
	if err != nil {
		return nil, err
	}
	c := p.CheckRun
	if c == nil || c.ID == 0 {
		return nil, malformed("check_run: payload has no check_run.id")
	}
	if _, _, err := repoParts(ev.Name, p.Repository); err != nil {
		return nil, err
	}
	row := &checkRunRow{ID: c.ID, Repository: p.Repository.FullName, Name: c.Name, HeadSHA: c.HeadSHA,
		Status: c.Status, HTMLURL: c.HTMLURL, Action: ev.Action, Updated: normalizedPtr(c.CompletedAt)}
	if row.Updated == nil {
		row.Updated = normalizedPtr(c.StartedAt)
	}
	if c.Conclusion != nil {
		row.Conclusion = *c.Conclusion
	}
	if p.RequestedAction != nil {
		row.RequestedAction = p.RequestedAction.Identifier
	}
	return row, nil
}

// pushRow is one github_pushes row.
type pushRow struct {
	Repository, HeadCommit, Ref, Before, Pusher string
	Commits                                     int
	Created, Deleted, Forced                    bool
}

// pushPayload is what decodePush reads of a payload.
type pushPayload struct {
	eventPayload
	Ref     string `json:"ref"`
	Before  string `json:"before"`
	After   string `json:"after"`
	Created bool   `json:"created"`
	Deleted bool   `json:"deleted"`
	Forced  bool   `json:"forced"`
	Pusher  *struct {
		Name string `json:"name"`
	} `json:"pusher"`
	Commits []json.RawMessage `json:"commits"`
}

func decodePush(ev *Event) (*pushRow, error) {
	p, err := decodeInto[pushPayload](ev)
	if err != nil {
		return nil, err
	}
	if p.Ref == "" || p.After == "" {
		return nil, malformed("push: payload has no ref or after")
	}
	if _, _, err := repoParts(ev.Name, p.Repository); err != nil {
		return nil, err
	}
	row := &pushRow{Repository: p.Repository.FullName, HeadCommit: p.After, Ref: p.Ref, Before: p.Before,
		Commits: len(p.Commits), Created: p.Created, Deleted: p.Deleted, Forced: p.Forced}
	if p.Pusher != nil {
		row.Pusher = p.Pusher.Name
	}
	return row, nil
}

// installationRow is one github_installations row.
type installationRow struct {
	ID                                        int64
	Account, AccountType, RepositorySelection string
	AppID                                     int64
	Event, Action                             string
	Suspended, Deleted                        bool
}

// repositoryRow is one github_repositories row.
type repositoryRow struct {
	Event, Action, Repository, Sender string
	RepositoryID                      int64
	Private                           *bool
}

// installationPayload is what decodeInstallation reads of a payload.
type installationPayload struct {
	eventPayload
	RepositorySelection string     `json:"repository_selection"`
	Added               []jsonRepo `json:"repositories_added"`
	Removed             []jsonRepo `json:"repositories_removed"`
}

func decodeInstallation(ev *Event) (*installationRow, []repositoryRow, error) {
	if ev.Name == "installation" && !slices.Contains(installationActions, ev.Action) {
		return nil, nil, nil
	}
	p, err := decodeInto[installationPayload](ev)
	if err != nil {
		return nil, nil, err
	}
	in := p.Installation
	if in == nil || in.ID == 0 {
		return nil, nil, malformed("%s: payload has no installation.id", ev.Name)
	}
	row := &installationRow{ID: in.ID, AppID: in.AppID, RepositorySelection: in.RepositorySelection,
		Event: ev.Name, Action: ev.Action, Deleted: ev.Action == "deleted",
		Suspended: ev.Action == "suspend" || (ev.Action != "unsuspend" && in.SuspendedAt != nil)}
	if p.RepositorySelection != "" {
		row.RepositorySelection = p.RepositorySelection
	}
	if in.Account != nil {
		row.Account, row.AccountType = in.Account.Login, in.Account.Type
	}
	var repos []repositoryRow
	if ev.Name == "installation_repositories" {
		for _, set := range []struct {
			action string
			list   []jsonRepo
		}{{"added", p.Added}, {"removed", p.Removed}} {
			for _, r := range set.list {
				if r.FullName == "" {
					return nil, nil, malformed("installation_repositories: a repository without full_name")
				}
				repos = append(repos, repositoryRow{Event: ev.Name, Action: set.action, Repository: r.FullName,
					Sender: login(p.Sender), RepositoryID: r.ID, Private: r.Private})
			}
		}
	}
	return row, repos, nil
}

// repositoryPayload is what decodeRepository reads of a payload.
type repositoryPayload struct {
	eventPayload
}

func decodeRepository(ev *Event) (repositoryRow, error) {
	p, err := decodeInto[repositoryPayload](ev)
	if err != nil {
		return repositoryRow{}, err
	}
	if _, _, err := repoParts(ev.Name, p.Repository); err != nil {
		return repositoryRow{}, err
	}
	return repositoryRow{Event: ev.Name, Action: ev.Action, Repository: p.Repository.FullName,
		Sender: login(p.Sender), RepositoryID: p.Repository.ID, Private: p.Repository.Private}, nil
}

// tableRows is decodeTableRows, once per Event: databasePrepare runs it
// ahead of the transaction, and the handler finds it done.
func (ev *Event) tableRows(botAppID int64) (*tableRows, error) {
	if ev.rows == nil && ev.rowsErr == nil {
		ev.rows, ev.rowsErr = decodeTableRows(ev, botAppID)
	}
	return ev.rows, ev.rowsErr
}
