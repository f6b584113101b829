package relay

// The push: what a downstream stream sends its client at each sync, type by
// type in xDS order, and the responses it emits.

import (
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// share makes the client's known tree the view itself when they hold the
// same content, so that streams in sync share one tree instead of each
// keeping its own copies of the paths it was sent.
func (sub *typeSub) share(view ledger.Tree[*xds.Resource]) {
	if sub.known.Root() == view.Root() {
		sub.known = view
	}
}

// target returns what a client subscribed as sub should hold of view.
func (sub *typeSub) target(view ledger.Tree[*xds.Resource]) ledger.Tree[*xds.Resource] {
	if sub.wildcard {
		return view
	}
	return partOf(view, sub.names)
}

// changes returns what the client lacks or holds at another hash (upd), and
// the names it holds that the view does not have (gone). whole reports
// that upd and gone are every difference between what the client holds
// and the whole view: applied, they leave the client holding the view
// itself (a wildcard subscription, or one that names all the view has).
func (sub *typeSub) changes(view ledger.Tree[*xds.Resource]) (upd []*xds.Resource, gone []string, whole bool) {
	if !sub.wildcard && len(sub.names)*4 < view.Len() {
		// A small subscription to a large view: look each name up.
		for _, n := range sub.names {
			w, wok := view.Get(n)
			k, kok := sub.known.Get(n)
			switch {
			case wok && (!kok || k.Hash != w.Hash):
				upd = append(upd, w.Value)
			case !wok && kok:
				gone = append(gone, n)
			}
		}
		return upd, gone, false
	}
	whole = true
	if sub.known.Len() == 0 {
		// A first sync sends about the whole view: one array, not the
		// dozen a growing one leaves behind (a 3,000-cluster CDS).
		upd = make([]*xds.Resource, 0, view.Len())
	}
	ledger.Diff(sub.known, view, func(c ledger.Change[*xds.Resource]) bool {
		switch {
		case c.New != nil && (sub.wildcard || sub.names.Has(c.Name)):
			upd = append(upd, c.New.Value)
		case c.New != nil:
			whole = false // the view has what the client does not ask for
		default:
			gone = append(gone, c.Name)
		}
		return true
	})
	return upd, gone, whole
}

// plan is what one sync round will send for one type.
type plan struct {
	sub *typeSub
	ts  *views.Type
	// stale: no live upstream stream confirmed the key's views (told to
	// peer relays, whose views it makes stale too).
	stale bool
	upd   []*xds.Resource
	gone  []string // removal candidates, not yet checked for references
	// want counts the updates and removals the client needs to hold all
	// it should of the view, done those sent (or applied) this round:
	// when they match, the client is in sync with the view once it applies
	// them.
	want, done int
	// whole: upd and gone are every difference between what the client
	// holds and the view itself (typeSub.changes), so once done reaches
	// want the client holds the view: its known tree becomes the view's,
	// without building a copy of it.
	whole bool
}

// sync brings the client up to the key's latest views: updates in push
// order (CDS, EDS, LDS, RDS, …), then removals in reverse dependency order,
// each removal held while something the client holds still refers to it.
func (s *stream) sync() error {
	if s.key == nil {
		return nil
	}
	if err := s.followSplits(); err != nil {
		return err
	}
	snap := s.key.published()
	now := time.Now()
	plans, synced := s.planTypes(snap, now)
	if err := s.sendUpdates(plans); err != nil {
		return err
	}
	if err := s.sendRemovals(plans); err != nil {
		return err
	}
	if err := s.sendProbe(plans); err != nil {
		return err
	}
	for _, ps := range [2][]*plan{synced, plans} {
		for _, p := range ps {
			if p.done == p.want {
				s.led.Synced(p.sub.typeURL, p.ts.View.Root(), now)
			}
		}
	}
	return nil
}

// planScratch is a stream's scratch for the plans of one sync: at most one a
// type, reused from sync to sync (a plan does not outlive its sync), so
// that a push allocates none.
type planScratch struct {
	buf            []plan
	planned, equal []*plan
}

// add returns a new plan p in the scratch.
func (ps *planScratch) add(p plan) *plan {
	if len(ps.buf) == cap(ps.buf) {
		return &p // more types than PushOrder lists: not reached
	}
	ps.buf = append(ps.buf, p)
	return &ps.buf[len(ps.buf)-1]
}

// reset empties the scratch for a new sync.
func (ps *planScratch) reset() {
	if ps.buf == nil {
		ps.buf = make([]plan, 0, len(xds.PushOrder))
	}
	clear(ps.buf[:cap(ps.buf)]) // no plan keeps the last sync's resources alive
	ps.buf, ps.planned, ps.equal = ps.buf[:0], ps.planned[:0], ps.equal[:0]
}

// planTypes decides, type by type in push order, what the stream sends
// of the key's view snap: plans holds the types with something to send
// (or an Order to pass on), synced those the client already holds. A type
// whose view is not known yet, or whose claimed version the tier is
// asked about, stops the walk: what comes later in push order waits.
func (s *stream) planTypes(snap *views.Set, now time.Time) (plans, synced []*plan) {
	s.plans.reset()
	plans, synced = s.plans.planned, s.plans.equal
	wait := s.srv.cfg.XDS.ResourceWaitTimeout
	for _, typeURL := range xds.PushOrder {
		sub := s.subs[typeURL]
		ts := snap.Types[typeURL]
		if sub == nil {
			continue
		}
		if ts == nil || !ts.Ready || (sub.wildcard && !ts.Full) {
			// The key's view of the type is not known yet: what comes
			// later in push order waits too, or a route could reach the
			// client before the clusters it uses (a client that moved to
			// this relay holds routes of an older view).
			break
		}
		if sub.declared {
			if s.claimPending(sub, ts) || s.awaitingEndpoints(sub, ts) {
				// The tier is asked what the client's version holds, or
				// the client's request for endpoints is awaited: what
				// comes later waits too, as for a type not known yet
				// (the answer, the request or the grace's end wakes the
				// stream).
				break
			}
			if !s.reconnected(sub, ts) {
				// The client holds a newer version of the type than the
				// key's view (it moved here from a relay that was further
				// on, or this relay restored an older snapshot): it keeps
				// all it has of the type until the view is at least as new
				// (the stream is woken on every new view), and gets only
				// the names it asks for and holds nothing of. What refers
				// to it is not sent before what it refers to
				// (deferDangling) and what it refers to is not removed
				// (heldBy).
				if upd := s.lacking(sub, ts); len(upd) > 0 {
					plans = append(plans, s.plans.add(plan{sub: sub, ts: ts, stale: snap.Stale, upd: upd, want: len(upd) + 1}))
				}
				continue
			}
		}
		upd, gone, whole := sub.changes(ts.View)
		want := len(upd) + len(gone)
		if want == 0 {
			sub.share(ts.View)
			sub.unsettled = false // nothing the relay could send replaces it
		}
		if s.peerRelay == nil {
			// An Envoy is never told that a name the source was asked for
			// and has not answered does not exist. Another relay is told
			// what the view holds, no more: it marks such a name pending
			// itself (feed.apply), and its view stays the owner's.
			gone = slices.DeleteFunc(gone, func(n string) bool { return ts.IsPending(n, now, wait) })
		}
		if typeURL == xds.TypeCluster {
			s.forceEndpoints(sub, upd)
		}
		p := s.plans.add(plan{sub: sub, ts: ts, stale: snap.Stale, upd: upd, gone: gone, want: want, whole: whole})
		switch {
		case len(upd) > 0 || len(gone) > 0 || sub.awaitFirst || s.orderNews(p):
			plans = append(plans, p)
		case want == 0:
			synced = append(synced, p)
		}
	}
	s.plans.planned, s.plans.equal = plans, synced // their arrays, for the next sync
	return plans, synced
}

// sendUpdates sends each plan's updates in push order, each after the
// plans before it went out (their clusters are held: deferDangling). A
// plan with no update after it in this round also sends the removals
// allowed now; the others' removals wait for sendRemovals, since an
// update later in the round may release what they hold back.
func (s *stream) sendUpdates(plans []*plan) error {
	// laterUpdates[i]: a plan after i has updates (read before their own
	// deferDangling, as they were planned).
	laterUpdates := make([]bool, len(plans))
	for i := len(plans) - 2; i >= 0; i-- {
		laterUpdates[i] = laterUpdates[i+1] || len(plans[i+1].upd) > 0
	}
	for i, p := range plans {
		s.deferDangling(p)
		var removed []string
		if !laterUpdates[i] {
			removed = s.allowedRemovals(p)
			p.gone = slices.DeleteFunc(p.gone, func(n string) bool { return slices.Contains(removed, n) })
		}
		if len(p.upd) > 0 || len(removed) > 0 || p.sub.awaitFirst || s.orderNews(p) {
			if err := s.emit(p, p.upd, removed); err != nil {
				return err
			}
		}
	}
	return nil
}

// sendRemovals sends, in removal order (referrers first), the removals
// still waiting that are allowed now.
func (s *stream) sendRemovals(plans []*plan) error {
	for _, typeURL := range xds.RemovalOrder {
		for _, p := range plans {
			if p.sub.typeURL != typeURL || len(p.gone) == 0 {
				continue
			}
			if removed := s.allowedRemovals(p); len(removed) > 0 {
				if err := s.emit(p, nil, removed); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// sendProbe answers the probe type as the client holds it, if the relay
// still has sent the client nothing (undeclared): an empty Delta response,
// or SotW's state unchanged, which the client answers like any other.
func (s *stream) sendProbe(plans []*plan) error {
	typeURL := s.probe
	if typeURL == "" || s.nonce != 0 {
		return nil
	}
	for _, p := range plans {
		if p.sub.typeURL == typeURL {
			p.sub.awaitFirst = true // answered even if nothing changed (SotW EDS, RDS)
			return s.emit(p, nil, nil)
		}
	}
	return nil
}

// orderNews reports whether a peer relay that holds everything the view
// has for it (want is zero) must be told of the view's new Order all the
// same: the owner renewed its upstream stream, or the upstream confirmed
// the same content, and the peer's own clients wait for a view that
// covers what they hold; or the key's views went stale or live again.
func (s *stream) orderNews(p *plan) bool {
	sub := p.sub
	return s.peerRelay != nil && s.delta && p.want == 0 && !sub.awaitFirst &&
		(p.ts.Order != sub.sentOrder || p.stale != sub.sentStale)
}

// emit applies upd and removed to the client's known state and sends the
// response that carries them.
func (s *stream) emit(p *plan, upd []*xds.Resource, removed []string) error {
	sub := p.sub
	p.done += len(upd) + len(removed)
	fromTree := sub.known
	from := fromTree.Root()
	apply := func() ledger.Tree[*xds.Resource] {
		kb := sub.known.Edit()
		for _, r := range upd {
			kb.Set(r.Name, r.Hash, r)
		}
		for _, n := range removed {
			kb.Delete(n)
		}
		return kb.Tree()
	}
	if p.whole && p.done == p.want {
		// Every difference is sent: the client holds the view (most
		// pushes: one change, to streams in sync), which every such
		// stream of the key then shares, with no copy built.
		if checkWhole {
			if got := apply().Root(); got != p.ts.View.Root() {
				panic(fmt.Sprintf("relay: a whole plan of %s leaves the client at %s, not the view's %s", sub.typeURL, got, p.ts.View.Root()))
			}
		}
		sub.known = p.ts.View
		sub.unsettled = false
	} else {
		sub.known = apply()
		sub.share(p.ts.View)
	}
	first := sub.awaitFirst
	sub.awaitFirst = false
	if sub.typeURL == xds.TypeCluster && len(removed) > 0 {
		s.dropEndpointsOf(fromTree, removed)
	}

	out := &wire.Response{TypeURL: sub.typeURL, Updated: upd, Removed: removed, From: from, To: sub.known.Root(), Order: p.ts.Order}
	if s.delta && s.peerRelay == nil && len(upd) == 0 && len(removed) > 0 {
		if c := s.carrier(sub.known, p.ts.View); c != nil {
			out.Updated, out.Carried = []*xds.Resource{c}, c.Hash
		}
	}
	if s.peerRelay != nil {
		// A peer relay takes the response's Order for its whole view of
		// the type, and serves its own clients by it: only a response
		// after which it holds exactly what this view has for it (the
		// plan's every difference sent) carries the view's Order as it is;
		// one that leaves something out, held back, pending or deferred,
		// carries it Mixed, and the peer mixes it with the Order of what it
		// kept (feed.apply).
		if p.done != p.want && !out.Order.IsZero() {
			out.Order.Mixed = true
		}
		sub.sentOrder, sub.sentStale = out.Order, p.stale
	}
	switch {
	case s.delta:
		out.View = p.ts.View.Root()
		out.Version = s.srv.versions.Of(out.View, out.Order)
		if s.peerRelay != nil && p.stale {
			out.Version = wire.MarkStale(out.Version)
		}
	case xds.FullStateSotW(sub.typeURL):
		out.From = ledger.Hash{}
		out.Version = s.srv.versions.Of(sub.known.Root(), out.Order)
		out.Full, out.Held = true, sub.known
		if sub.known.Root() != p.ts.View.Root() {
			s.key.sentHeld(sub.known) // it may claim it elsewhere
		}
	default:
		// SotW cannot say "removed" for these types: a removal only
		// updates what the relay knows the client holds.
		if len(upd) == 0 && !first {
			return nil
		}
		out.Version = s.srv.versions.Of(sub.known.Root(), out.Order)
	}
	out.Nonce = s.nextNonce()
	now := time.Now()
	sent := sentResponse{nonce: out.Nonce, version: out.Version, at: now, from: fromTree, to: sub.known}
	if s.delta {
		sub.inflight = append(sub.inflight, sent)
		if len(sub.inflight) > maxInflight {
			sub.inflight = sub.inflight[len(sub.inflight)-maxInflight:]
		}
	} else {
		sub.nonce = out.Nonce
	}
	sub.sent = sent
	s.updateStatus(sub.typeURL, func(st *TypeStatus) { st.SentVersion, st.SentAt = out.Version, now })
	s.led.Sent(sub.typeURL, now)
	if err := s.send(out); err != nil {
		return err
	}
	if s.log.Enabled(s.ctx, slog.LevelDebug) {
		s.log.Debug("push", "type", xds.ShortType(sub.typeURL), "version", out.Version, "nonce", out.Nonce,
			"resources", len(upd), "removed", len(removed))
	}
	return nil
}

// dropEndpointsOf unsubscribes the client from the endpoints of the
// clusters removed, which it held as before: Envoy drops a cluster's EDS
// subscription, and the assignment it held, with the cluster, and asks for
// them again only if the cluster comes back. The request that says so may
// be read late, or not at all (a SotW request with a stale nonce is not
// read, and the next one repeats the list the relay already has once the
// cluster is back): the relay took the assignment for held, sent a route
// to the returned cluster while it was warming, and never sent the
// assignment (loadtest chaos seed 20 of issue 28's fifty at 920f085). An
// assignment another cluster the client holds still uses stays. Another
// relay is no Envoy: it keeps what it was sent.
func (s *stream) dropEndpointsOf(before ledger.Tree[*xds.Resource], removed []string) {
	eds, cds := s.subs[xds.TypeEndpoint], s.subs[xds.TypeCluster]
	if s.peerRelay != nil || eds == nil || eds.wildcard || cds == nil {
		return
	}
	// What the client holds may be known by hash alone (a claim the tier
	// knew, a declaration): its body is looked up, and a cluster whose body
	// is nowhere is taken to use the endpoints of its own name, as Istio's
	// and most clusters do. Dropping too much only costs sending an
	// assignment again, which Envoy takes as no change (chaos, issue 28's
	// wider envelope: a returned cluster's route went out while it warmed,
	// on a stream whose clusters were known by hash).
	var still map[string]struct{}
	if !opaque(cds.known) {
		still = s.srv.cache.refIndex.Names(cds.known, xds.RefEndpoints)
	} else {
		still = make(map[string]struct{})
		for e := range cds.known.All() {
			if r := s.heldBody(e); r != nil {
				for _, cla := range r.Refs(xds.RefEndpoints) {
					still[cla] = struct{}{}
				}
			}
		}
	}
	var drop []string
	for _, n := range removed {
		e, ok := before.Get(n)
		if !ok {
			continue
		}
		clas := []string{n}
		if r := s.heldBody(e); r != nil {
			clas = r.Refs(xds.RefEndpoints)
		}
		for _, cla := range clas {
			if _, used := still[cla]; !used && eds.names.Has(cla) && !slices.Contains(drop, cla) {
				drop = append(drop, cla)
			}
		}
	}
	if len(drop) == 0 {
		return
	}
	s.resubscribe(eds, false, eds.names.With(nil, drop), nil)
	eds.listID = wire.ListID{} // the client's next list is read, whatever it repeats
}

// heldBody returns the resource of an entry of what the client holds: its
// own, or, known by hash alone, the store's (nil if the store has it no
// more).
func (s *stream) heldBody(e ledger.Entry[*xds.Resource]) *xds.Resource {
	if e.Value != nil {
		return e.Value
	}
	if e.Hash == unknownContent {
		return nil
	}
	return s.srv.store.Lookup(e.Hash)
}

// carrier returns, for a Delta response that only removes, one resource the
// client holds after it (nil if it holds nothing), sent again as it is:
// its version then carries the response's Order. A Delta client declares
// what it holds resource by resource when it reconnects, and a removal
// leaves no version behind: without it, an Envoy that was told a resource
// is gone would declare only older versions, and a relay whose view is
// older than the removal, and still has the resource, would be taken to
// cover it and send it again (the simulation found an endpoint of a
// removed service back at generation 1 after 17). Envoy takes a resource
// sent again unchanged as no change. What the client declared when it
// reconnected is held by hash alone until the relay sends it something
// (its body may be the view's, or in the store).
func (s *stream) carrier(known, view ledger.Tree[*xds.Resource]) *xds.Resource {
	for e := range known.All() {
		r := e.Value
		if r == nil {
			if v, ok := view.Get(e.Name); ok && v.Hash == e.Hash {
				r = v.Value
			} else {
				r = s.heldBody(e)
			}
		}
		if r != nil {
			return r
		}
	}
	return nil
}

// checkWhole makes emit check what plan.whole lets it skip: that the
// client's known tree, built, would be the view. The package's tests set
// it (whole_test.go).
var checkWhole bool

// claimPending reports whether sub's claimed version is being looked up in
// the tier, and applies the answer once it came.
func (s *stream) claimPending(sub *typeSub, ts *views.Type) bool {
	s.resolveClaim(sub, ts)
	l := sub.lookup
	if l == nil {
		return false
	}
	select {
	case <-l.done:
	default:
		return true
	}
	sub.lookup = nil
	if l.ok {
		sub.known, sub.claimKnown = l.held, true
		s.srv.metrics.Claims.WithLabelValues(l.from).Inc()
	} else {
		s.claimUnknown(sub)
	}
	return false
}

// claimUnknown notes that nobody knows what sub's claimed version holds:
// what the client holds of the type may refer to anything, and a
// full-state answer may remove what its routes use.
func (s *stream) claimUnknown(sub *typeSub) {
	s.srv.metrics.Claims.WithLabelValues("unknown").Inc()
	s.log.Info("a SotW client's version is known to no relay of the tier", "type", xds.ShortType(sub.typeURL), "version", sub.claimed.String())
}
