// Package views holds what the relay keeps of each aggregation key as its
// streams read it: the key's published views (Set), one per xDS type
// (Type). A key's feed publishes a new Set whole, copy on write (TypeOf,
// MarkPending), and every stream of the key reads the latest one without
// a lock: a published Set, and each Type in it, is never modified again.
// The views are the seam between the two layers of the data path: the
// key's cache and feed write them, the downstream server reads them.
package views

import (
	"maps"
	"time"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// Set is the published state of a key: its views of every type. It is
// immutable.
type Set struct {
	Types map[string]*Type
	// Stale is set while the views come from a cache that no live upstream
	// stream has confirmed (the upstream is unreachable).
	Stale bool
	// Restored is set while the views are a snapshot restored at start
	// (warm start) that no source has confirmed yet (for the admin API:
	// the views' Orders say how new they are against what clients hold).
	Restored bool
}

// Type is the published state of one type of a key: its view. It is
// immutable.
type Type struct {
	View ledger.Tree[*xds.Resource]
	// Order says how new the view is (ledger.Order): set by the key's
	// source when the view arrived, taken from the owner by a relay that
	// subscribes to it; zero for a view restored from a snapshot. A client
	// whose version the view does not cover keeps it.
	Order ledger.Order
	// Ready is set once the upstream has answered for this type: before
	// that an empty view means "not known yet", not "nothing exists".
	Ready bool
	// Full is set while the view is everything the upstream has of the
	// type (it answered a wildcard subscription), not just the names asked
	// for. Wildcard clients wait for it.
	Full bool
	// Pending holds names requested from the upstream that have not
	// arrived, with the time they were first requested. A stream never
	// tells a client that a pending name does not exist.
	Pending map[string]time.Time
	// Gone holds, in the clusters' view, the clusters that left it while a
	// route or listener of the key's views still named them, with the
	// relay's clock when they left. Such a route is the source's word
	// only on a stream opened after that: a source changes its routes
	// before it removes the clusters they named, so until then it may be
	// the route the change replaces (the relay's holds). Nil for other
	// types.
	Gone map[string]ledger.Stamp
}

// IsPending reports whether name was asked of the source less than wait
// before now and has not arrived.
func (t *Type) IsPending(name string, now time.Time, wait time.Duration) bool {
	at, ok := t.Pending[name]
	return ok && now.Sub(at) < wait
}

// TypeOf returns a copy of the Type of typeURL, for modification.
func (s *Set) TypeOf(typeURL string) *Type {
	if t := s.Types[typeURL]; t != nil {
		c := *t
		return &c
	}
	return &Type{}
}

// MarkPending marks, in views being built (not yet published), the names
// of typeURL that its view does not hold and that are not pending yet as
// pending since now: asked of the source, so that no stream reports them
// missing before the source had a chance to send them. The pending map is
// copied on write (older views share it); nothing is stored if no name is
// new.
func (s *Set) MarkPending(typeURL string, names []string, now time.Time) {
	var ts *Type
	var pending map[string]time.Time
	for _, n := range names {
		if ts == nil {
			ts = s.TypeOf(typeURL)
		}
		if _, ok := ts.View.Get(n); ok {
			continue
		}
		if _, ok := ts.Pending[n]; ok {
			continue
		}
		if pending == nil {
			pending = maps.Clone(ts.Pending)
			if pending == nil {
				pending = make(map[string]time.Time, len(names))
			}
		}
		pending[n] = now
	}
	if pending != nil {
		ts.Pending = pending
		s.Types[typeURL] = ts
	}
}
