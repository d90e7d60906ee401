// The typed bot tables' rows, each with the payload type its decoder reads:
// branches, issues and pull requests, comments, discussions, check runs,
// pushes, installations and repositories. github_tables.go maps Event names
// to them.

package main

import (
	"encoding/json"
	"slices"
	"strings"
)

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

func decodeBranch(ev *Event, src decodedPayload) (*branchRow, error) {
	p, err := decodeInto[branchPayload](ev, src)
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

func decodeIssue(ev *Event, src decodedPayload) (*issueRow, error) {
	if !slices.Contains(issueActions, ev.Action) {
		return nil, nil
	}
	p, err := decodeInto[issuePayload](ev, src)
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

func decodePullRequest(ev *Event, src decodedPayload) (*issueRow, error) {
	if !slices.Contains(pullActions, ev.Action) {
		return nil, nil
	}
	p, err := decodeInto[pullRequestPayload](ev, src)
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

func decodeComment(ev *Event, src decodedPayload) (*commentRow, error) {
	if !slices.Contains(commentActions, ev.Action) {
		return nil, nil
	}
	p, err := decodeInto[commentPayload](ev, src)
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

func decodeDiscussion(ev *Event, src decodedPayload) (*discussionRow, error) {
	actions := discussionActions
	if ev.Name == "discussion_comment" {
		actions = commentActions
	}
	if !slices.Contains(actions, ev.Action) {
		return nil, nil
	}
	p, err := decodeInto[discussionPayload](ev, src)
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

func decodeCheckRun(ev *Event, src decodedPayload) (*checkRunRow, error) {
	if !slices.Contains(checkRunActions, ev.Action) {
		return nil, nil
	}
	p, err := decodeInto[checkRunPayload](ev, src)
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

func decodePush(ev *Event, src decodedPayload) (*pushRow, error) {
	p, err := decodeInto[pushPayload](ev, src)
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

func decodeInstallation(ev *Event, src decodedPayload) (*installationRow, []repositoryRow, error) {
	if ev.Name == "installation" && !slices.Contains(installationActions, ev.Action) {
		return nil, nil, nil
	}
	p, err := decodeInto[installationPayload](ev, src)
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

func decodeRepository(ev *Event, src decodedPayload) (repositoryRow, error) {
	p, err := decodeInto[repositoryPayload](ev, src)
	if err != nil {
		return repositoryRow{}, err
	}
	if _, _, err := repoParts(ev.Name, p.Repository); err != nil {
		return repositoryRow{}, err
	}
	return repositoryRow{Event: ev.Name, Action: ev.Action, Repository: p.Repository.FullName,
		Sender: login(p.Sender), RepositoryID: p.Repository.ID, Private: p.Repository.Private}, nil
}
