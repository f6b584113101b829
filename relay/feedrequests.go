package relay

// What a key's feed asks its source: the subscriptions its members and
// its views need, as SotW or Delta requests, and the versions a new Delta
// stream declares.

import (
	"fmt"
	"maps"
	"slices"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// declareViews sets, for every type, the versions a new Delta stream
// declares to what the key's views hold: the relay's content hashes and
// the views' Orders, which a peer relay recognises and orders.
func (u *feed) declareViews() {
	snap := u.k.views.Load()
	for typeURL, ut := range u.types {
		ts := snap.Types[typeURL]
		var view ledger.Tree[*xds.Resource]
		var order ledger.Order
		if ts != nil {
			view, order = ts.View, ts.Order
		}
		u.setVersions(ut, versionTreeOf(view, func(h ledger.Hash) string { return wire.Version(h, order) }))
	}
}

// setVersions makes b the versions of ut, shared with the keys that hold
// the same (keyCache.versionTrees).
func (u *feed) setVersions(ut *feedType, b *ledger.Builder[string]) {
	ut.versions, ut.versionsSet = u.c.versionTrees.Intern(b.Tree()), true
}

// versionTreeOf is a versions tree declaring each resource of view at the
// version its content hash gives.
func versionTreeOf(view ledger.Tree[*xds.Resource], version func(ledger.Hash) string) *ledger.Builder[string] {
	b := ledger.Tree[string]{}.Edit()
	for e := range view.All() {
		v := version(e.Hash)
		b.Set(e.Name, versionHash(v), v)
	}
	return b
}

// versionHash is a version's leaf hash in a versions tree.
func versionHash(v string) ledger.Hash { return ledger.HashBytes([]byte(v)) }

// desired computes what to ask the upstream for, by type: what the member
// streams subscribe to, plus the names the key's views point at, less the
// unknown names past maxUnknownNames (boundUnknown).
func (u *feed) desired() map[string]subscription {
	want := u.k.wanted()
	for typeURL, names := range u.derived {
		if len(names) == 0 {
			continue
		}
		set, ok := u.derivedSets[typeURL]
		if !ok {
			set = xds.NewNameSet(slices.Collect(maps.Keys(names)))
			u.derivedSets[typeURL] = set
		}
		w := want[typeURL]
		w.names = w.names.Union(set)
		want[typeURL] = w
	}
	snap := u.k.views.Load()
	for typeURL, w := range want {
		var view ledger.Tree[*xds.Resource]
		if ts := snap.Types[typeURL]; ts != nil {
			view = ts.View
		}
		w.names = boundUnknown(w.names, view, u.derived[typeURL])
		want[typeURL] = w
	}
	return want
}

// maxUnknownNames bounds, per type, the names a key asks its source for
// that neither its views hold nor its other views point at: names a
// client made up (or holds from config the key no longer has). Envoy asks
// for endpoints and routes its clusters and listeners name, which the
// key's views point at; a client that invents a million names does not
// make the key's stream to istiod ask for them. The names past the bound
// are not asked and stay missing to the clients that want them (absent
// after XDS.ResourceWaitTimeout). Those the source answers become known,
// so a type whose names nothing points at (secrets by name, say) is asked
// for the next ones as answers come.
const maxUnknownNames = 10_000

// boundUnknown returns names less the unknown ones (not in view, not in
// derived) past the first maxUnknownNames, in name order; names itself if
// none goes.
func boundUnknown(names xds.NameSet, view ledger.Tree[*xds.Resource], derived map[string]int) xds.NameSet {
	if len(names) <= maxUnknownNames {
		return names
	}
	unknown := 0
	var drop []string
	for _, n := range names {
		if _, ok := derived[n]; ok {
			continue
		}
		if _, ok := view.Get(n); ok {
			continue
		}
		if unknown++; unknown > maxUnknownNames {
			drop = append(drop, n)
		}
	}
	if len(drop) == 0 {
		return names
	}
	return names.With(nil, drop)
}

// resubscribe sends a request for every type whose subscription differs from
// what the current stream was asked, and drops from the views the names no
// longer wanted.
func (u *feed) resubscribe() error {
	want := u.desired()
	if u.k.memberCount() == 0 {
		// Nobody is connected: keep asking for what the last members asked
		// for, so that they find the key warm if they come back.
		want = make(map[string]subscription, len(u.types))
		for typeURL, ut := range u.types {
			if ut.wildcard || len(ut.names) > 0 {
				want[typeURL] = subscription{wildcard: ut.wildcard, names: ut.names}
			}
		}
	}
	for _, typeURL := range slices.Sorted(maps.Keys(u.types)) {
		if _, ok := want[typeURL]; !ok && u.types[typeURL].asked {
			want[typeURL] = subscription{} // unsubscribe everything
		}
	}
	for _, typeURL := range slices.Sorted(maps.Keys(want)) {
		w := want[typeURL]
		ut := u.types[typeURL]
		if ut == nil {
			ut = &feedType{}
			u.types[typeURL] = ut
		}
		if ut.asked && ut.wildcard == w.wildcard && sameSet(ut.names, w.names) {
			continue // asked already: most members' requests change nothing here
		}
		// Shared by content: per-node keys of one view ask for one set.
		names := u.c.nameSets.Intern(w.names)
		if ut.asked && w.wildcard && !ut.wildcard {
			// Turning a named subscription into a wildcard on a live stream,
			// the next response may still answer the named one: nothing
			// says when the view becomes the full set. A new stream asks
			// for the wildcard from its first request.
			return errResubscribe
		}
		if !w.wildcard {
			u.notFull(typeURL)
			u.dropUnwanted(typeURL, names)
		}
		var req proto.Message
		if u.delta {
			req = u.deltaSubscribe(typeURL, ut, w.wildcard, names)
		} else {
			sr := u.sotwRequest(typeURL, ut, w.wildcard, names, nil)
			if u.renewing {
				// A SotW upstream answers a stream's first request only
				// if its version differs from the one reported: a renewal
				// needs the answers.
				sr.VersionInfo = ""
			}
			if !ut.asked {
				ut.told = sr.VersionInfo != ""
			}
			req = sr
		}
		ut.asked, ut.wildcard, ut.names = true, w.wildcard, names
		if err := u.send(req); err != nil {
			return fmt.Errorf("subscribe %s: %w", xds.ShortType(typeURL), err)
		}
		u.log("upstream subscription", "type", xds.ShortType(typeURL), "wildcard", w.wildcard, "names", len(names))
	}
	return nil
}

// notFull marks typeURL's view as holding only named resources: wildcard
// clients wait until the upstream answers a wildcard subscription again.
func (u *feed) notFull(typeURL string) {
	u.k.mu.Lock()
	defer u.k.mu.Unlock()
	if ts := u.k.views.Load().Types[typeURL]; ts != nil && ts.Full {
		u.k.update(func(next *views.Set) {
			c := next.TypeOf(typeURL)
			c.Full = false
			next.Types[typeURL] = c
		})
	}
}

// dropUnwanted removes from a view the names nobody asks for any more.
func (u *feed) dropUnwanted(typeURL string, names xds.NameSet) {
	ts := u.k.views.Load().Types[typeURL]
	if ts == nil {
		return
	}
	var drop []string
	for e := range ts.View.All() {
		if !names.Has(e.Name) {
			drop = append(drop, e.Name)
		}
	}
	if len(drop) > 0 {
		u.apply(typeURL, nil, drop, false, false, ledger.Order{})
	}
	// The upstream must not be told on a reconnect that the key still
	// holds what it dropped: nor, before anything was declared, that a
	// restored view holds it (the rest of that view is still declared).
	ut := u.types[typeURL]
	if ut == nil || len(drop) == 0 {
		return
	}
	if !ut.versionsSet {
		b := ut.declare.Edit()
		for _, n := range drop {
			b.Delete(n)
		}
		ut.declare = b.Tree()
		return
	}
	b := ut.versions.Edit()
	for _, n := range drop {
		b.Delete(n)
	}
	u.setVersions(ut, b)
}

// sotwRequest builds a SotW request: version_info is the last ACKed version
// (kept across reconnects), the nonce that of the latest response on this
// stream.
func (u *feed) sotwRequest(typeURL string, ut *feedType, wildcard bool, names xds.NameSet, nack *rpcstatus.Status) *discovery.DiscoveryRequest {
	rn := xds.SotWResourceNames(wildcard, names, ut.named)
	ut.named = ut.named || len(rn) > 0
	return &discovery.DiscoveryRequest{
		TypeUrl:       typeURL,
		VersionInfo:   ut.acked,
		ResourceNames: rn,
		ResponseNonce: ut.nonce,
		ErrorDetail:   nack,
	}
}

// deltaSubscribe builds a Delta request that moves the stream's subscription
// to (wildcard, names); on a new stream it declares what the key holds.
func (u *feed) deltaSubscribe(typeURL string, ut *feedType, wildcard bool, names xds.NameSet) *discovery.DeltaDiscoveryRequest {
	req := &discovery.DeltaDiscoveryRequest{TypeUrl: typeURL}
	if !ut.asked {
		if wildcard && len(names) > 0 {
			req.ResourceNamesSubscribe = append([]string{xds.WildcardName}, names...)
		} else {
			req.ResourceNamesSubscribe = names
		}
		if !ut.versionsSet && ut.declare.Len() > 0 {
			u.setVersions(ut, versionTreeOf(ut.declare, ledger.Hash.String))
		}
		ut.declare = ledger.Tree[*xds.Resource]{}
		if ut.versions.Len() > 0 {
			req.InitialResourceVersions = make(map[string]string, ut.versions.Len())
			for e := range ut.versions.All() {
				req.InitialResourceVersions[e.Name] = e.Value
			}
			if sourceKind(u.k.source.Load()) != sourcePeer {
				// Probe: one resource declared at a version no server has,
				// so that the upstream answers the type even when nothing
				// else changed, and silence is never taken for "current".
				// (A relay answers its peers on every type anyway.)
				probe := slices.Min(slices.Collect(maps.Keys(req.InitialResourceVersions)))
				req.InitialResourceVersions[probe] = probeVersion
			}
		}
		return req
	}
	added, removed := ut.names.Diff(names)
	if wildcard && !ut.wildcard {
		added = append(added, xds.WildcardName)
	}
	if !wildcard && ut.wildcard {
		removed = append(removed, xds.WildcardName)
	}
	// Versions of names no longer wanted go with the names, in
	// dropUnwanted; under a wildcard they are still wanted.
	req.ResourceNamesSubscribe, req.ResourceNamesUnsubscribe = added, removed
	return req
}

// probeVersion is declared for one resource of each type on a new Delta
// upstream stream: no server holds it, so the server sends that resource.
const probeVersion = "meshrelay-probe"
