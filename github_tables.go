package main

import (
	"fmt"
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

// tableDecoder is what the tables take of the Events of one name: the
// payload type its decoder reads, which DecodeEvent decodes the payload into
// (each embeds eventPayload, so that one pass decodes what the Event and its
// rows read), and the decoder, which fills rows. Release tracking reads
// every repository's Events (everyApp), the typed tables the bot App's only.
type tableDecoder struct {
	everyApp bool
	payload  func() tablePayload
	decode   func(ev *Event, src decodedPayload, rows *tableRows) error
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
		decode: func(ev *Event, src decodedPayload, r *tableRows) (err error) {
			r.Release, err = decodeRelease(ev, src)
			return err
		}}, "release")
	add(tableDecoder{everyApp: true, payload: func() tablePayload { return new(workflowRunPayload) },
		decode: func(ev *Event, src decodedPayload, r *tableRows) (err error) {
			r.WorkflowRun, err = decodeWorkflowRun(ev, src)
			return err
		}}, "workflow_run")
	add(tableDecoder{payload: func() tablePayload { return new(branchPayload) },
		decode: func(ev *Event, src decodedPayload, r *tableRows) (err error) {
			r.Branch, err = decodeBranch(ev, src)
			return err
		}}, "create", "delete")
	add(tableDecoder{payload: func() tablePayload { return new(issuePayload) },
		decode: func(ev *Event, src decodedPayload, r *tableRows) (err error) {
			r.Issue, err = decodeIssue(ev, src)
			return err
		}}, "issues")
	add(tableDecoder{payload: func() tablePayload { return new(pullRequestPayload) },
		decode: func(ev *Event, src decodedPayload, r *tableRows) (err error) {
			r.Issue, err = decodePullRequest(ev, src)
			return err
		}}, "pull_request")
	add(tableDecoder{payload: func() tablePayload { return new(commentPayload) },
		decode: func(ev *Event, src decodedPayload, r *tableRows) (err error) {
			r.Comment, err = decodeComment(ev, src)
			return err
		}},
		"issue_comment", "pull_request_review_comment", "commit_comment")
	add(tableDecoder{payload: func() tablePayload { return new(discussionPayload) },
		decode: func(ev *Event, src decodedPayload, r *tableRows) (err error) {
			r.Discussion, err = decodeDiscussion(ev, src)
			return err
		}},
		"discussion", "discussion_comment")
	add(tableDecoder{payload: func() tablePayload { return new(checkRunPayload) },
		decode: func(ev *Event, src decodedPayload, r *tableRows) (err error) {
			r.CheckRun, err = decodeCheckRun(ev, src)
			return err
		}}, "check_run")
	add(tableDecoder{payload: func() tablePayload { return new(pushPayload) },
		decode: func(ev *Event, src decodedPayload, r *tableRows) (err error) {
			r.Push, err = decodePush(ev, src)
			return err
		}}, "push")
	add(tableDecoder{payload: func() tablePayload { return new(installationPayload) },
		decode: func(ev *Event, src decodedPayload, r *tableRows) (err error) {
			r.Installation, r.Repositories, err = decodeInstallation(ev, src)
			return err
		}}, "installation", "installation_repositories")
	add(tableDecoder{payload: func() tablePayload { return new(repositoryPayload) },
		decode: func(ev *Event, src decodedPayload, r *tableRows) error {
			repo, err := decodeRepository(ev, src)
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

// decodeTableRows decodes what ev writes, from src (its payload as
// DecodeEvent read it, or nothing): release tracking for every repository,
// then the typed tables for the bot App's Events.
func decodeTableRows(ev *Event, src decodedPayload, botAppID int64) (*tableRows, error) {
	rows := &tableRows{}
	bot := isBotEvent(ev, botAppID)
	if d, ok := tableDecoders[ev.Name]; ok && (d.everyApp || bot) {
		if err := d.decode(ev, src, rows); err != nil || !bot {
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

func decodeRelease(ev *Event, src decodedPayload) (*releaseRow, error) {
	p, err := decodeInto[releasePayload](ev, src)
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

func decodeWorkflowRun(ev *Event, src decodedPayload) (*workflowRunRow, error) {
	p, err := decodeInto[workflowRunPayload](ev, src)
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
