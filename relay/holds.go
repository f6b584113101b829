package relay

// Holds: what a push keeps back so that an Envoy never holds a resource
// that names one it cannot use yet (make-before-break across types), nor
// loses what it asked for.

import (
	"slices"
	"sync"
	"time"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// forceEndpoints makes the stream send again, after the clusters of upd,
// the endpoints of every cluster that changed or came. Envoy warms an
// updated cluster only when its ClusterLoadAssignment arrives, even if the
// endpoints did not change. A cluster new to the client holds no
// assignment, whatever the relay sent before: Envoy drops a cluster's
// assignment with the cluster, and ignores one that arrives for no cluster
// it holds, such as the answer to a request for it that crossed the
// cluster's removal and was read late (loadtest chaos, 5 relays and 200
// Envoys, seed 1 of 2026-12-06: a starved relay took such an assignment
// for held when the cluster came back, and sent its route while it was
// warming). An assignment another cluster the client holds uses is held.
// Another relay is no Envoy: it keeps what it was sent.
func (s *stream) forceEndpoints(cds *typeSub, upd []*xds.Resource) {
	eds := s.subs[xds.TypeEndpoint]
	if eds == nil {
		return
	}
	var kb *ledger.Builder[*xds.Resource]
	var used map[string]struct{} // the assignments the client's clusters use
	for _, r := range upd {
		_, had := cds.known.Get(r.Name)
		if !had && s.peerRelay != nil {
			continue
		}
		for _, e := range r.Refs(xds.RefEndpoints) {
			if _, ok := eds.known.Get(e); !ok {
				continue
			}
			if !had {
				if used == nil {
					used = s.srv.cache.refIndex.Names(cds.known, xds.RefEndpoints)
				}
				if _, ok := used[e]; ok {
					continue
				}
			}
			if kb == nil {
				kb = eds.known.Edit()
			}
			if !had {
				kb.Delete(e) // not held: sent again if the key has it
				continue
			}
			// Held at unknown content: sent again if the key has it,
			// removed if not.
			kb.Set(e, unknownContent, nil)
		}
	}
	if kb != nil {
		eds.known = kb.Tree()
	}
}

// allowedRemovals returns the removal candidates of p that nothing the client
// holds refers to any more. Another relay gets every removal at once: its
// view is the owner's (a view partly its own would have to be ordered as
// its older part: ledger.Order.Mix), and it holds what its own Envoys'
// routes use back from them itself.
func (s *stream) allowedRemovals(p *plan) []string {
	if s.peerRelay != nil {
		return slices.Clone(p.gone) // the callers take them out of p.gone
	}
	var out []string
	for _, n := range p.gone {
		if !s.heldBy(p.sub.typeURL, n) {
			out = append(out, n)
		}
	}
	return out
}

// heldBy reports whether something the client holds refers to name of
// typeURL, so removing it now would break make-before-break.
func (s *stream) heldBy(typeURL, name string) bool {
	in := xds.RefsTo(typeURL)
	if len(in) == 0 {
		return false
	}
	for _, e := range in {
		if s.refers(e.From, e.Kind, name) {
			return true
		}
	}
	return s.undeclared(typeURL)
}

// clusterUsable reports whether the client can send traffic to cluster c
// of its subscription cds: it holds c and, for a cluster that takes its
// endpoints from EDS, c's ClusterLoadAssignment. Envoy keeps a new cluster
// warming until its assignment arrives, and a route to a warming cluster
// fails (no_cluster, 503); an updated cluster is replaced only once warm,
// so one held before (its assignment held, at any content) is usable. A
// cluster the client declared on reconnect is usable once its assignment
// is held too: Envoy declares a warming cluster as well. Another
// relay is no Envoy: it holds its own Envoys' routes until they can use
// them, and gets everything else at once, so that its views keep up with
// this one's.
//
// byBody reports that the verdict came from what the client holds alone
// (the cluster's body at the content it holds, its endpoints' names): the
// same for every client that holds the same (usableKey).
func (s *stream) clusterUsable(cds *typeSub, c string) (usable, byBody bool) {
	e, ok := cds.known.Get(c)
	if !ok {
		return false, true
	}
	if s.peerRelay != nil {
		return true, false
	}
	held := e.Value
	byBody = held != nil
	if held == nil {
		// Declared at content the relay had not seen then: a client
		// declares a cluster it holds, warm or not, so its endpoints are
		// checked all the same, by the content if the relay has it now,
		// else by the key's cluster of that name (its endpoints' name
		// rarely changes). A cluster nobody here knows is taken as it
		// was: a route to it is dangling whatever the relay does.
		if held = s.srv.store.Lookup(e.Hash); held == nil && s.key != nil {
			if ts := s.key.published().Types[xds.TypeCluster]; ts != nil {
				v, _ := ts.View.Get(c)
				held = v.Value
			}
		}
		if held == nil {
			return true, false
		}
	}
	eds := s.subs[xds.TypeEndpoint]
	for _, n := range held.Refs(xds.RefEndpoints) {
		if eds == nil {
			return false, byBody
		}
		if _, ok := eds.known.Get(n); !ok {
			return false, byBody
		}
	}
	return true, byBody
}

// hold is a listener or route configuration held back by deferDangling.
type hold struct {
	since time.Time
	// at is the relay's clock when the hold began: after the resource, of
	// content hash, came. Views of the key's clusters and of the
	// resource's type from upstream streams opened later are the source's
	// word on what it serves (absentProven). A new content of the resource
	// is held anew.
	at   ledger.Stamp
	hash ledger.Hash
	told bool // its wait ended and the relay said so
}

// deferDangling holds back, from a plan of listeners or route
// configurations, those that use a cluster the client cannot use yet
// (clusterUsable): make-before-break across types. The clusters of this
// sync went out first (CDS precedes EDS, LDS and RDS), and the endpoints
// of a new cluster come once the client asks for them.
//
// No wait ends by a clock. A resource that uses a cluster the key's view
// holds (or has asked its source for) waits for it however long it takes:
// the cluster is on its way. One that uses a cluster the key's view does
// not have waits until the source is proven not to serve it: the key's
// clusters, and the resource's own view, came on upstream streams opened
// after the resource did (absentProven). A source may send types out of
// order, and the clusters may be slow to come (a large CDS response on a
// slow link: loadtest chaos seed 31 of issue 28's 50), so a view of the
// same stream proves nothing. Past ResourceWaitTimeout the relay says so
// (meshrelay_make_before_break_overdue_total{outcome="held"}, a warning;
// the ledger counts the Envoy behind) and, for a cluster the view does not
// have, asks the key's source for a new stream (keyState.demand), whose
// answer is the proof either way. A resource sent on that proof names a
// cluster the source's own config does not serve (istiod routes to a host
// it does not know), which Envoy answers with 503 with or without the
// relay (outcome="sent").
func (s *stream) deferDangling(p *plan) {
	if p.sub.typeURL != xds.TypeRoute && p.sub.typeURL != xds.TypeListener {
		return
	}
	cds := s.subs[xds.TypeCluster]
	if cds == nil || len(p.upd) == 0 {
		return
	}
	now := time.Now()
	wait := s.srv.cfg.XDS.ResourceWaitTimeout
	var keyCDS *views.Type
	if s.key != nil {
		keyCDS = s.key.published().Types[xds.TypeCluster]
	}
	// Another relay's verdicts are its own (clusterUsable); an Envoy's are
	// every Envoy's that holds the same.
	memo := s.peerRelay == nil
	var uk usableKey
	if memo {
		uk.cds = cds.known.Root()
		if eds := s.subs[xds.TypeEndpoint]; eds != nil {
			uk.eds = eds.known.Root()
		}
	}
	kept := p.upd[:0]
	for _, r := range p.upd {
		missing, coming := false, false
		var left ledger.Stamp // the latest a missing cluster left the key's view (views.Type.Gone)
		uk.hash = r.Hash
		known := memo && s.srv.usable.has(uk)
		byBody := memo
		for _, c := range r.Refs(xds.RefClusters) {
			if known {
				break
			}
			usable, pure := s.clusterUsable(cds, c)
			byBody = byBody && pure
			if usable {
				continue
			}
			missing = true
			if keyCDS != nil {
				if _, ok := keyCDS.View.Get(c); ok || keyCDS.IsPending(c, now, wait) {
					coming = true
					break
				}
				left = max(left, keyCDS.Gone[c])
			}
		}
		if !missing && byBody && !known {
			s.srv.usable.add(uk)
		}
		if !missing && len(s.dangling) == 0 {
			kept = append(kept, r) // the common case: no key built, nothing to forget
			continue
		}
		key := p.sub.typeURL + "|" + r.Name
		if missing {
			h := s.dangling[key]
			if h == nil || h.hash != r.Hash {
				if s.dangling == nil {
					s.dangling = make(map[string]*hold)
				}
				h = &hold{since: now, at: s.srv.clock.Now(), hash: r.Hash}
				s.dangling[key] = h
			}
			if coming || !absentProven(keyCDS, p.ts, h.at, left) {
				if now.Sub(h.since) < wait {
					s.wakeAt(h.since.Add(wait))
					continue
				}
				if !h.told {
					h.told = true
					s.srv.metrics.Holds.WithLabelValues(xds.ShortType(p.sub.typeURL), "held").Inc()
					s.log.Warn("a resource is held back past the wait: a cluster it uses is not warm at the client yet",
						"type", xds.ShortType(p.sub.typeURL), "name", r.Name, "waited", now.Sub(h.since).Round(time.Millisecond),
						"cluster_in_view", coming)
				}
				if !coming {
					s.key.demandAnswers(max(h.at, left))
				}
				continue
			}
			s.srv.metrics.Holds.WithLabelValues(xds.ShortType(p.sub.typeURL), "sent").Inc()
		}
		delete(s.dangling, key)
		kept = append(kept, r)
	}
	p.upd = kept
}

// absentProven reports whether the key's clusters, cds, are the source's
// word that it does not serve the missing clusters a resource (held since
// at, of view ts) names. A source adds a cluster before the routes that
// name it, but may send the route first (go-control-plane's Delta server
// answers a type only once its last answer was ACKed, and a starved relay
// ACKs late), so arrival order on one stream proves nothing: the clusters
// must come on an upstream stream opened after the resource came (its
// first answer is computed after the resource was; a view made of parts
// has the earliest of their streams). A cluster that left the view while
// routes named it (left: views.Type.Gone) may be one whose route's change
// has not come yet (a source changes routes before it removes their
// clusters). Either way the resource's own view must come on such a
// stream too, whose first answer has the resource as it is now: the
// clusters of a new stream may come before its routes, and until they
// do the route is the old stream's (loadtest chaos of 2026-12-07, seed 1:
// a key moved from a starved owner to the upstream, whose clusters came
// 35 ms before its routes). A source that stays silent on the type (a
// SotW upstream told the version the relay holds) is made to answer by
// the demand the hold raises past its wait (feed.renewal). A frozen relay
// that resumed sent a route of its old stream, naming a cluster its new
// stream's clusters had dropped (the simulation's seed 54); the wider
// chaos runs of 2026-12-06 found the other cases.
func absentProven(cds, ts *views.Type, at, left ledger.Stamp) bool {
	if cds == nil || ts == nil {
		return false
	}
	since := max(at, left)
	return since.Before(cds.Order.Session) && since.Before(ts.Order.Session)
}

// wakeAt has the stream woken at due at the latest (a held resource's
// deadline, the end of a wait for a request): one timer for all of them,
// moved earlier if need be; each sync that still waits calls it again, so
// the timer is armed while anything waits. A wake for a wait that ended
// meanwhile costs a sync with nothing to do. The stream's goroutine calls
// it.
func (s *stream) wakeAt(due time.Time) {
	if s.danglingTimer != nil && !s.danglingDue.After(due) && time.Now().Before(s.danglingDue) {
		return // it fires first; the sync it causes arms it again for the rest
	}
	if s.danglingTimer != nil {
		s.danglingTimer.Stop()
	}
	s.danglingDue = due
	s.danglingTimer = time.AfterFunc(time.Until(due), func() { wake(s.wake) })
}

// reconnected settles what a reconnecting client declared it holds of
// sub's type (Delta initial_resource_versions, SotW version_info) against
// the key's view ts, and reports whether the view may be sent: the client
// holds the view's content, or the view covers the Orders of what it holds
// (ledger.Order). Otherwise the client keeps what it has, reconnected is
// asked again at the next view, and if the view's upstream stream is too
// old to ever cover what the client holds, the key's source is asked for a
// new one (keyState.demand). Once settled, the view is the truth for the
// client.
func (s *stream) reconnected(sub *typeSub, ts *views.Type) bool {
	t := sub.target(ts.View)
	held := sub.known.Root()
	if !sub.claimed.IsZero() {
		held = sub.claimed
	}
	current := t.Root() == held
	if !current && !sub.coveredBy(ts) {
		for _, o := range sub.orders {
			if !ts.Order.Covers(o) && !ts.Order.SameStream(o) {
				s.key.demand(o.At, s.peerRelay != nil)
			}
		}
		return false
	}
	if current && !sub.claimed.IsZero() {
		// A SotW client that reported what the view holds is current:
		// nothing to send.
		version := wire.Version(sub.claimed, ts.Order)
		sub.known, sub.awaitFirst = t, false
		s.updateStatus(sub.typeURL, func(st *TypeStatus) {
			st.SentVersion, st.AckedVersion = version, version
		})
	}
	if !current && !sub.claimed.IsZero() && !sub.claimKnown {
		sub.unsettled = true
		s.keepAskedClusters(sub, ts)
	}
	sub.orders, sub.claimed, sub.claimKnown, sub.declared = nil, ledger.Hash{}, false, false
	return true
}

// keepAskedClusters puts in what a SotW client holds of the clusters (sub,
// claimed at a version nobody knew) those it asks endpoints for that the
// view ts no longer has, at the newest content the key's history kept:
// Envoy asks for the assignment of every EDS cluster it holds, warm or
// warming, so it holds these, and a route it holds may still use them.
// Without them, the first full-state answer would remove them at once,
// before the routes that replace the client's are sent (make-before-break);
// with them, they are removal candidates, held back while anything the
// client holds may refer to them (heldBy) and removed once its routes are
// the view's. A relay killed before anyone kept what it had sent leaves
// only its Envoys knowing their versions (the simulation's seeds 2400 and
// 2708 of issue 28). A cluster whose endpoints go by another name than its
// own, or whose content the history no longer has, is not kept.
func (s *stream) keepAskedClusters(sub *typeSub, ts *views.Type) {
	eds := s.subs[xds.TypeEndpoint]
	if s.delta || sub.typeURL != xds.TypeCluster || eds == nil || s.key == nil {
		return
	}
	var gone []string
	for _, n := range eds.names {
		if _, ok := ts.View.Get(n); !ok {
			if _, ok := sub.known.Get(n); !ok {
				gone = append(gone, n)
			}
		}
	}
	kept := s.key.lastContent(xds.TypeCluster, gone)
	if base := s.baseKey(); base != nil && len(kept) < len(gone) {
		// A key of a node of its own, new since a split, has no history
		// of what the node's key sent it (loadtest chaos, wider than the
		// default, seed 4 of 2026-12-05).
		for _, c := range kept {
			gone = slices.DeleteFunc(gone, func(n string) bool { return n == c.Name })
		}
		kept = append(kept, base.lastContent(xds.TypeCluster, gone)...)
	}
	if len(kept) == 0 {
		return
	}
	kb := sub.known.Edit()
	for _, c := range kept {
		if slices.Contains(c.Refs(xds.RefEndpoints), c.Name) {
			kb.Set(c.Name, c.Hash, c)
		}
	}
	sub.known = kb.Tree()
}

// baseKey returns the key the stream's node belongs to but for a split, if
// the stream is on a key of its own and the relay holds that key.
func (s *stream) baseKey() joinedKey {
	key, base := s.srv.cache.keyOf(s.node, s.identity)
	if key == base || s.key == nil || s.key.name() != key {
		return nil
	}
	if k := s.srv.cache.key(base); k != nil {
		return k
	}
	return nil // not a nil *keyState in an interface
}

// awaitingEndpoints reports whether a SotW client's clusters, claimed at a
// version nobody knew, wait for its request for endpoints, which tells
// what it holds (keepAskedClusters): Envoy sends it with the others when
// the stream opens, so the wait ends once it came, once the client
// answered anything (every first request came), or declareGrace after the
// stream opened (the stream is woken then).
func (s *stream) awaitingEndpoints(sub *typeSub, ts *views.Type) bool {
	if s.delta || sub.typeURL != xds.TypeCluster || sub.claimed.IsZero() || sub.claimKnown ||
		s.subs[xds.TypeEndpoint] != nil || s.answered || sub.target(ts.View).Root() == sub.claimed {
		return false
	}
	left := declareGrace - time.Since(s.opened)
	if left <= 0 {
		return false
	}
	s.wakeAt(time.Now().Add(left))
	return true
}

// coveredBy reports whether the view ts is at least as new as everything
// the client declared (ledger.Order): whether its source is live or not
// says nothing of that (a relay frozen for a while, resumed, has a live
// stream ten seconds behind), its Order does.
func (sub *typeSub) coveredBy(ts *views.Type) bool {
	return !ts.Order.IsZero() && sub.orders.coveredBy(ts.Order)
}

// resolveClaim turns a SotW client's claimed version into what it holds,
// once, if the key's history has that version: from then on the relay
// knows each resource the client holds, as it does a Delta client's, and
// holds back the removal of what they still refer to (a full-state CDS
// response that left out a cluster the client's routes use would remove
// it). A claim of the view's content needs nothing; one the history lacks
// is asked of the tier (askTier, claims.go). A claim nobody knows stays a
// root: what the client holds of the type may refer to anything.
func (s *stream) resolveClaim(sub *typeSub, ts *views.Type) {
	if sub.claimed.IsZero() || sub.claimTried {
		return
	}
	sub.claimTried = true
	if sub.target(ts.View).Root() == sub.claimed {
		return // current (reconnected)
	}
	if t, ok := s.heldVersion(sub); ok {
		sub.known, sub.claimKnown = t, true
		s.srv.metrics.Claims.WithLabelValues("history").Inc()
		return
	}
	if !s.srv.host.askTier(s, sub) {
		s.claimUnknown(sub)
	}
}

// heldVersion returns what the key's history says a client subscribed as
// sub holds at its claimed version. The history keeps names and hashes;
// the bodies must still be in the store (a full-state response carries
// every resource the client holds), or the claim stays unresolved.
func (s *stream) heldVersion(sub *typeSub) (ledger.Tree[*xds.Resource], bool) {
	t, ok := s.key.versionHeld(sub.typeURL, sub.wildcard, sub.names, sub.claimed)
	if !ok {
		return t, false
	}
	b := t.Edit()
	for e := range t.All() {
		if e.Value != nil {
			continue
		}
		r := s.srv.store.Lookup(e.Hash)
		if r == nil {
			return ledger.Tree[*xds.Resource]{}, false
		}
		b.Set(e.Name, e.Hash, r)
	}
	return b.Tree(), true
}

// lacking returns what a Delta client subscribes to by name, holds nothing
// of, and the view has: sent to a client that otherwise keeps what it
// holds. A name asked for by name and not held is one the client never had
// (an Envoy asks for the endpoints and routes of what it holds, and the
// relay removes none of them while it does), so any content of it is new
// to it. A wildcard subscription or a SotW one gets nothing (a name the
// client lacks may be one its newer version removed, and a SotW client said
// only a root), and neither does a view restored from a snapshot (of
// unknown age, as old as the snapshot: the client may have held the name,
// newer, before). Nor does another relay: the name is new to it, not to
// its Envoys, which may hold it newer from elsewhere; it would serve them
// this view's older content as its own (loadtest chaos, 5 relays and 200
// Envoys, seed 8 of 2026-12-06: a new owner whose view lagged behind gave
// the relays that moved to it the endpoints their SotW Envoys had asked
// for, older than those the Envoys held, which they were sent).
func (s *stream) lacking(sub *typeSub, ts *views.Type) []*xds.Resource {
	if !s.delta || sub.wildcard || ts.Order.IsZero() || s.peerRelay != nil {
		return nil
	}
	view := ts.View
	var out []*xds.Resource
	for _, n := range sub.names {
		if _, held := sub.known.Get(n); held {
			continue
		}
		if e, ok := view.Get(n); ok {
			out = append(out, e.Value)
		}
	}
	return out
}

// heldByOrder reports whether the client keeps what it holds of typeURL
// because the key's view does not cover what the client declared (see
// reconnected; for tests of the model).
func (s *stream) heldByOrder(typeURL string) bool {
	sub := s.subs[typeURL]
	if sub == nil || s.key == nil || !sub.declared {
		return false
	}
	snap := s.key.published()
	ts := snap.Types[typeURL]
	return ts != nil && !sub.coveredBy(ts)
}

// deferred reports whether name of typeURL is held back by deferDangling
// (for tests of the model).
func (s *stream) deferred(typeURL, name string) bool {
	_, ok := s.dangling[typeURL+"|"+name]
	return ok
}

// declareGrace is the least a reconnected client's removals wait for it to
// declare the types that may refer to them (awaitingDeclarations).
const declareGrace = time.Second

// awaitingDeclarations reports whether removals of typeURL wait for the
// client to declare a referring type: a type that refers to typeURL and
// that clients declare (xds.TypeRef.Declared) was not requested yet, and
// the client has not answered a response on this stream, or did so within
// declareGrace of its start. A client that reconnects (to another relay,
// after a move or a crash) declares its state type by type, CDS first
// (Delta initial_resource_versions, SotW version_info): without the wait,
// a cluster removed while it was away would go out before the relay learns
// that a route it holds still uses it. Envoy sends every type's first
// request when the stream opens, before it reads a response, and requests
// arrive in order: once it has answered one, every declaration it will
// make has come, however slow its link (one second of waiting alone once
// let a cluster go under a route whose declaration a lossy link delayed:
// loadtest chaos seed 3 of issue 28's 50). The second is kept for a
// client that answers before it declares everything.
func (s *stream) awaitingDeclarations(typeURL string) (bool, time.Duration) {
	left := declareGrace - time.Since(s.opened)
	if s.answered && left <= 0 {
		return false, 0
	}
	for _, e := range xds.RefsTo(typeURL) {
		if e.Declared && s.subs[e.From] == nil {
			return true, left
		}
	}
	return false, 0
}

// undeclared is awaitingDeclarations. If the relay has sent the client
// nothing yet, no answer is coming: the type is answered as the client
// holds it (sync's probe), and the answer to that ends the wait. If the
// client has answered, the stream is woken when the grace ends.
func (s *stream) undeclared(typeURL string) bool {
	wait, left := s.awaitingDeclarations(typeURL)
	switch {
	case !wait:
	case !s.answered && s.nonce == 0 && s.probe == "":
		s.probe = typeURL
	case s.answered && !s.graceArmed:
		s.graceArmed = true
		time.AfterFunc(left, func() { wake(s.wake) })
	}
	return wait
}

func (s *stream) refers(typeURL string, kind xds.RefKind, name string) bool {
	sub := s.subs[typeURL]
	if sub == nil {
		return false
	}
	if !sub.claimed.IsZero() && !sub.claimKnown || sub.unsettled {
		// A SotW client said it holds a version of the type the relay
		// does not know (resolveClaim), and has not been sent all of
		// the view since: it may refer to anything.
		return true
	}
	if sub.known.Len() == 0 {
		return false
	}
	if _, ok := s.srv.cache.refIndex.Names(sub.known, kind)[name]; ok {
		return true
	}
	// The client declared content this relay has never seen (it came
	// from another relay): it may refer to anything, until the relay has
	// replaced it, later in the same sync if the key has it.
	return opaque(sub.known)
}

// opaque reports whether a tree holds a resource of unknown content (a
// client's declaration the relay could not resolve, which lasts until the
// sync that replaces it). It walks the tree, stopping at the first one:
// once per removal candidate, and removals are few.
func opaque(t ledger.Tree[*xds.Resource]) bool {
	for e := range t.All() {
		if e.Value == nil {
			return true
		}
	}
	return false
}

// usableKey names a verdict of deferDangling that holds for every Envoy
// stream alike: a route or listener of content hash uses only clusters the
// client can use, given what it holds of clusters (cds, a tree root) and
// of endpoints (eds). A root fixes each name's content hash, and a content
// hash the clusters and endpoints a body names, so the verdict is a
// function of the three, as long as it was reached from the clusters'
// bodies alone (clusterUsable's byBody).
type usableKey struct {
	hash, cds, eds ledger.Hash
}

// maxUsable bounds the verdicts a relay remembers; they are forgotten all
// at once when it is reached.
const maxUsable = 1 << 14

// usableSet remembers the routes and listeners found usable, so that the
// streams of a key in sync check each once, not once a stream: the check
// was 35–38 % of a full sync's CPU (loadtest/results/issue32-sync-research.md).
// Only "usable" is remembered: a route held back is checked again on each
// sync, as its wait needs. Safe for concurrent use.
type usableSet struct {
	mu sync.Mutex
	m  map[usableKey]struct{}
}

func (u *usableSet) has(k usableKey) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	_, ok := u.m[k]
	return ok
}

func (u *usableSet) add(k usableKey) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.m == nil || len(u.m) >= maxUsable {
		u.m = make(map[usableKey]struct{})
	}
	u.m[k] = struct{}{}
}
