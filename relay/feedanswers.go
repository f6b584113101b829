package relay

// What a key's feed does with its source's answers: decode, NACK what it
// cannot use, apply to the key's views in order, follow the names they
// point at, and expire names the source never answered.

import (
	"fmt"
	"maps"
	"slices"
	"time"
	"unique"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/adsclient"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// handle processes one upstream response.
func (u *feed) handle(m adsclient.Response) error {
	defer m.Release() // every resource is decoded or copied by now
	switch resp := m.(type) {
	case *wire.SotWIn:
		return u.onSotW(resp)
	case *wire.DeltaIn:
		return u.onDelta(resp)
	}
	return nil
}

func (u *feed) onSotW(resp *wire.SotWIn) error {
	typeURL := resp.GetTypeUrl()
	ut := u.types[typeURL]
	if ut == nil || !ut.asked {
		// Not asked for on this stream: an ACK would subscribe to it
		// (an empty list is the legacy wildcard), so say nothing.
		u.log("unsolicited upstream response", "type", xds.ShortType(typeURL))
		return nil
	}
	ut.nonce = resp.GetNonce()
	upd, err := u.decodeAll(typeURL, len(resp.Resources), func(i int) (*xds.Resource, error) {
		return u.c.store.Decode(typeURL, resp.Resources[i], "")
	})
	if err != nil {
		return u.nack(typeURL, ut, resp.GetVersionInfo(), resp.GetNonce(), err)
	}
	if !ut.wildcard {
		upd = slices.DeleteFunc(upd, func(r *xds.Resource) bool { return !ut.names.Has(r.Name) })
	}
	full := xds.FullStateSotW(typeURL)
	var gone []string
	if !full && !ut.answered {
		// A SotW response of a type whose responses may carry only what
		// changed (EDS, RDS) is merged into the view; but the first one
		// on a stream carries every name the stream asked for that the
		// upstream has (a new stream has been sent nothing). The view's
		// other names are what an earlier stream (or a snapshot) left,
		// of another age than this stream's Order says: they go, pending
		// (no client is told they do not exist before ResourceWaitTimeout),
		// and the view is this stream's alone.
		gone = namesNotIn(u.k.views.Load().Types[typeURL], upd)
	}
	ut.answered = true
	u.apply(typeURL, upd, gone, full, true, u.arrived())
	ut.acked = resp.GetVersionInfo()
	return u.send(u.sotwRequest(typeURL, ut, ut.wildcard, ut.names, nil))
}

func (u *feed) onDelta(resp *wire.DeltaIn) error {
	typeURL := resp.GetTypeUrl()
	ut := u.types[typeURL]
	if ut == nil {
		ut = &feedType{}
		u.types[typeURL] = ut
	}
	res := slices.DeleteFunc(resp.Resources, func(r wire.ResourceIn) bool {
		return r.Body == nil // a TTL heartbeat: nothing changed
	})
	upd, err := u.decodeAll(typeURL, len(res), func(i int) (*xds.Resource, error) {
		return u.c.store.Decode(typeURL, res[i].Body, res[i].Name)
	})
	if err != nil {
		return u.nack(typeURL, ut, "", resp.GetNonce(), err)
	}
	wanted := func(name string) bool { return ut.wildcard || ut.names.Has(name) }
	vb := ut.versions.Edit()
	kept := upd[:0]
	for i, r := range upd {
		if wanted(r.Name) {
			kept = append(kept, r)
			v := unique.Make(res[i].Version).Value() // one string for every key
			vb.Set(r.Name, versionHash(v), v)
		}
	}
	removed := resp.GetRemovedResources()
	if xds.Singleton(typeURL) {
		removed = singletonRemoved(removed, len(kept) > 0)
	}
	for _, n := range removed {
		vb.Delete(n)
	}
	u.setVersions(ut, vb)
	if ut.asked {
		u.apply(typeURL, kept, removed, false, true, u.orderOf(resp))
	}
	return u.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResponseNonce: resp.GetNonce()})
}

// singletonRemoved reads a Delta response's removals of a Singleton type:
// its one resource is removed only by a response that carries none and
// removes a name that is not the wildcard. istiod, which answers such a
// type's subscription of "*" with the unnamed resource, removes "*" in the
// same response (every subscribed name it did not send).
func singletonRemoved(removed []string, carried bool) []string {
	if carried {
		return nil
	}
	for _, n := range removed {
		if n != xds.WildcardName {
			return []string{xds.SingletonName} // whatever the upstream named it
		}
	}
	return nil
}

// decodeAll decodes n resources, refusing the whole response if any fails
// or a name repeats.
func (u *feed) decodeAll(typeURL string, n int, decode func(int) (*xds.Resource, error)) ([]*xds.Resource, error) {
	out := make([]*xds.Resource, 0, n)
	seen := make(map[string]struct{}, n)
	for i := range n {
		r, err := decode(i)
		if err != nil {
			return nil, fmt.Errorf("resource %d: %w", i, err)
		}
		if _, dup := seen[r.Name]; dup {
			return nil, fmt.Errorf("resource %q appears twice", r.Name)
		}
		seen[r.Name] = struct{}{}
		out = append(out, r)
	}
	return out, nil
}

// nack refuses a response the relay could not decode: the key keeps its last
// good view, and the upstream hears why. Only the relay's own decoding ever
// NACKs upstream: an Envoy's NACK stays with that Envoy.
func (u *feed) nack(typeURL string, ut *feedType, version, nonce string, cause error) error {
	u.c.metrics.UpstreamNACKs.WithLabelValues(xds.ShortType(typeURL)).Inc()
	u.c.log.Warn("upstream response refused", "key", u.k.key, "type", xds.ShortType(typeURL), "version", version, "err", cause)
	detail := &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: cause.Error()}
	if u.delta {
		return u.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResponseNonce: nonce, ErrorDetail: detail})
	}
	return u.send(u.sotwRequest(typeURL, ut, ut.wildcard, ut.names, detail))
}

// arrived returns the Order of a view the upstream just sent on the current
// stream.
func (u *feed) arrived() ledger.Order {
	return ledger.Order{Session: u.sessionAt, At: u.c.clock.Now()}
}

// orderOf returns the Order of a Delta response: the owner's, carried in its
// system_version_info, from a peer relay (and whether the owner's views are
// stale: ownerStale); arrived, from the upstream.
func (u *feed) orderOf(resp *wire.DeltaIn) ledger.Order {
	if sourceKind(u.k.source.Load()) != sourcePeer {
		return u.arrived()
	}
	v, stale := wire.CutStale(resp.GetSystemVersionInfo())
	u.ownerStale = stale
	_, o, err := wire.ParseVersion(v)
	if err != nil || o.IsZero() {
		// An owner whose view is of unknown age (restored from a
		// snapshot), or of a release before Orders: so is the view, and
		// it covers nothing a client holds.
		return ledger.Order{}
	}
	u.c.observe(o, "owner", string(u.k.key))
	return o
}

// apply publishes a new view of typeURL: upd set, del removed, and with
// replace everything else removed too (a SotW full-state response). A view
// from the key's source (fromSource) has order and marks the type ready;
// otherwise (the relay itself dropped names nobody asks for) the view keeps
// its Order and is no longer the full set. A Mixed order from the owner
// (it sent part of its view: see stream.emit) leaves the view holding
// parts of the old one: its Order is the mix of both.
func (u *feed) apply(typeURL string, upd []*xds.Resource, del []string, replace, fromSource bool, order ledger.Order) {
	k := u.k
	received := time.Now()
	k.mu.Lock()
	var derivedChanged bool
	var view ledger.Tree[*xds.Resource]
	var viewOrder ledger.Order
	var gone []*xds.Resource // what the view dropped, kept a while (keyCache.dropped)
	k.update(func(next *views.Set) {
		ts := next.TypeOf(typeURL)
		old := ts.View
		b := old.Edit()
		var removed []string // names the view no longer holds
		if replace {
			keep := make(map[string]struct{}, len(upd))
			for _, r := range upd {
				keep[r.Name] = struct{}{}
			}
			for e := range old.All() {
				if _, ok := keep[e.Name]; !ok {
					b.Delete(e.Name)
					gone = append(gone, e.Value)
					removed = append(removed, e.Name)
				}
			}
		}
		for _, r := range upd {
			if cur, ok := b.Get(r.Name); !ok || cur.Hash != r.Hash {
				if ok {
					gone = append(gone, cur.Value)
				}
				b.Set(r.Name, r.Hash, r)
			}
		}
		for _, n := range del {
			if cur, ok := b.Get(n); ok {
				gone = append(gone, cur.Value)
				removed = append(removed, n)
			}
			b.Delete(n)
		}
		ts.View = u.c.views.Intern(b.Tree())
		if typeURL == xds.TypeCluster {
			ts.Gone = u.clustersGone(next, ts.Gone, removed, upd)
		}
		if fromSource {
			if order.Mixed && old.Len() > 0 {
				order = ts.Order.Mix(order)
			}
			ts.Ready, ts.Order = true, order
		}
		// The view is the full set only once the source answered a
		// wildcard subscription. One the relay cut itself (dropUnwanted,
		// as the type stops being wildcard) is not, from the moment it
		// is published: a stream that syncs in between must not take
		// the cut view, at its old Order, for everything the source has
		// (loadtest chaos of 2026-12-07, seed 3: an Envoy told to remove
		// every listener it held).
		ts.Full = fromSource && u.types[typeURL].wildcard
		ts.Pending = withoutArrived(ts.Pending, upd)
		if fromSource && (sourceKind(k.source.Load()) == sourcePeer || !u.delta) {
			// A name removed here that this relay's members still ask for
			// by name is pending, not absent, where the removal does not
			// say the upstream lacks it: an owner tells another relay of
			// the removal of a name it asked the upstream for and has not
			// heard of (its own Envoys are not told: see
			// stream.planTypes), and a SotW stream's first answer leaves
			// out what an earlier one left in the view (onSotW). So they
			// are not told it does not exist before the upstream had a
			// chance to say so. (A Delta upstream's removal says so.)
			ts.Pending = withPending(ts.Pending, stillWanted(u.types[typeURL], del), received)
		}
		next.Types[typeURL] = ts
		derivedChanged = u.follow(next, typeURL, old, ts.View)
		view, viewOrder = ts.View, ts.Order
	})
	k.mu.Unlock()
	k.c.dropped.Keep(gone)
	k.recordView(typeURL, view, received, viewOrder)
	k.wakeStreams()
	if derivedChanged {
		wake(k.upWake) // ask the upstream for the names the new view points at
	}
	u.armExpiry()
	if fromSource {
		u.c.persist(u.k)
	}
}

// namesNotIn returns the names ts's view holds that upd does not.
func namesNotIn(ts *views.Type, upd []*xds.Resource) []string {
	if ts == nil || ts.View.Len() == 0 {
		return nil
	}
	in := make(map[string]struct{}, len(upd))
	for _, r := range upd {
		in[r.Name] = struct{}{}
	}
	var out []string
	for e := range ts.View.All() {
		if _, ok := in[e.Name]; !ok {
			out = append(out, e.Name)
		}
	}
	return out
}

// stillWanted returns the names of del that ut, a type subscribed to by
// name, still asks for.
func stillWanted(ut *feedType, del []string) []string {
	if ut == nil || ut.wildcard {
		return nil
	}
	var out []string
	for _, n := range del {
		if ut.names.Has(n) {
			out = append(out, n)
		}
	}
	return out
}

// withPending returns pending with names pending since at, those not
// pending already (a new map if it changes).
func withPending(pending map[string]time.Time, names []string, at time.Time) map[string]time.Time {
	var out map[string]time.Time
	for _, n := range names {
		if _, ok := pending[n]; ok {
			continue
		}
		if out == nil {
			out = make(map[string]time.Time, len(pending)+len(names))
			maps.Copy(out, pending)
		}
		out[n] = at
	}
	if out == nil {
		return pending
	}
	return out
}

// clustersGone returns the clusters' Gone (views.Type) after an answer
// that removed the clusters removed and brought upd: the removed ones that
// a route or listener of next still names left now; one back in the view,
// or that nothing names any more, is forgotten (a new map if it changes).
func (u *feed) clustersGone(next *views.Set, gone map[string]ledger.Stamp, removed []string, upd []*xds.Resource) map[string]ledger.Stamp {
	if len(gone) == 0 && len(removed) == 0 {
		return gone
	}
	named := make(map[string]struct{})
	for _, typeURL := range []string{xds.TypeRoute, xds.TypeListener} {
		if ts := next.Types[typeURL]; ts != nil {
			maps.Copy(named, u.c.refIndex.Names(ts.View, xds.RefClusters))
		}
	}
	out := make(map[string]ledger.Stamp, len(gone)+len(removed))
	for n, at := range gone {
		if _, ok := named[n]; ok {
			out[n] = at
		}
	}
	for _, r := range upd {
		delete(out, r.Name)
	}
	now := u.c.clock.Now()
	for _, n := range removed {
		if _, ok := named[n]; ok {
			out[n] = now
		}
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// withoutArrived returns pending minus the names in upd (a new map if it
// changes).
func withoutArrived(pending map[string]time.Time, upd []*xds.Resource) map[string]time.Time {
	if len(pending) == 0 {
		return pending
	}
	arrived := 0
	for _, r := range upd {
		if _, ok := pending[r.Name]; ok {
			arrived++
		}
	}
	switch arrived {
	case 0:
		return pending
	case len(pending):
		return nil // the common case: a key's first answer brings every name it waited for
	}
	// Copied at the size it keeps, not cloned and emptied: a key waits for
	// thousands of endpoints at start.
	gone := make(map[string]struct{}, arrived)
	for _, r := range upd {
		gone[r.Name] = struct{}{}
	}
	out := make(map[string]time.Time, len(pending)-arrived)
	for n, at := range pending {
		if _, ok := gone[n]; !ok {
			out[n] = at
		}
	}
	return out
}

// follow updates the derived names after typeURL's view went from old to
// cur, marking the new ones pending in next. It reports whether the set of
// derived names changed.
func (u *feed) follow(next *views.Set, typeURL string, old, cur ledger.Tree[*xds.Resource]) bool {
	changed := false
	for _, e := range xds.RefsFrom(typeURL) {
		if e.Fetched && u.followEdge(next, e.To, e.Kind, old, cur) {
			changed = true
		}
	}
	return changed
}

// followEdge is follow for one edge of xds.TypeRefs: the names of target that
// the view's resources refer to by kind.
func (u *feed) followEdge(next *views.Set, target string, kind xds.RefKind, old, cur ledger.Tree[*xds.Resource]) bool {
	counts := u.derived[target]
	if counts == nil {
		counts = make(map[string]int)
		u.derived[target] = counts
	}
	var added []string
	changed := false
	ledger.Diff(old, cur, func(c ledger.Change[*xds.Resource]) bool {
		if c.Old != nil {
			for _, n := range c.Old.Value.Refs(kind) {
				if counts[n]--; counts[n] <= 0 {
					delete(counts, n)
					changed = true
				}
			}
		}
		if c.New != nil {
			for _, n := range c.New.Value.Refs(kind) {
				if counts[n]++; counts[n] == 1 {
					added = append(added, n)
					changed = true
				}
			}
		}
		return true
	})
	next.MarkPending(target, added, time.Now())
	if changed {
		delete(u.derivedSets, target)
	}
	return changed
}

// armExpiry sets the timer for the earliest pending name to expire.
func (u *feed) armExpiry() {
	var earliest time.Time
	for _, ts := range u.k.views.Load().Types {
		for _, at := range ts.Pending {
			if earliest.IsZero() || at.Before(earliest) {
				earliest = at
			}
		}
	}
	if earliest.IsZero() {
		return
	}
	d := time.Until(earliest.Add(u.c.cfg.ResourceWaitTimeout))
	if d < 0 {
		d = 0
	}
	if u.expiry == nil {
		u.expiry = time.NewTimer(d)
	} else {
		u.expiry.Reset(d)
	}
}

func (u *feed) expiryC() <-chan time.Time {
	if u.expiry == nil {
		return nil
	}
	return u.expiry.C
}

// expirePending forgets names that never arrived: from now on streams may
// tell clients they do not exist.
func (u *feed) expirePending() {
	now := time.Now()
	wait := u.c.cfg.ResourceWaitTimeout
	k := u.k
	k.mu.Lock()
	k.update(func(next *views.Set) {
		for typeURL, ts := range next.Types {
			var keep map[string]time.Time
			changed := false
			for n, at := range ts.Pending {
				if now.Sub(at) >= wait {
					changed = true
					continue
				}
				if keep == nil {
					keep = make(map[string]time.Time)
				}
				keep[n] = at
			}
			if changed {
				c := *ts
				c.Pending = keep
				next.Types[typeURL] = &c
				u.log("names never arrived", "type", xds.ShortType(typeURL))
			}
		}
	})
	k.mu.Unlock()
	k.wakeStreams()
	u.armExpiry()
}

// checkIdle starts the idle timer when the key has no members and stops it
// when it has.
func (u *feed) checkIdle() {
	n := u.k.memberCount()
	switch {
	case n == 0 && u.idle == nil:
		wait := u.c.cfg.Keys.IdleTimeout
		if u.c.nobodyComesBack(u.k) {
			wait = 0
		}
		u.idle = time.NewTimer(wait)
	case n == 0 && u.c.nobodyComesBack(u.k):
		u.idle.Reset(0) // learnt while it idled
	case n > 0 && u.idle != nil:
		u.idle.Stop()
		u.idle = nil
	}
}

func (u *feed) idleC() <-chan time.Time {
	if u.idle == nil {
		return nil
	}
	return u.idle.C
}

func (u *feed) stopTimers() {
	if u.idle != nil {
		u.idle.Stop()
	}
	if u.expiry != nil {
		u.expiry.Stop()
	}
}
