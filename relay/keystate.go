package relay

import (
	"iter"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/divergence"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// keyState is what the relay holds for one aggregation key: the views the
// upstream sent, who subscribes to what, the members (the streams joined to
// it), and the upstream stream that feeds them.
//
// Writers (the key's feed, and streams changing their
// subscriptions) take mu and publish new immutable views.Set; streams read
// the latest views.Set without locking.
type keyState struct {
	key aggkey.Key
	c   *keyCache

	views atomic.Pointer[views.Set]

	// upWake wakes the key's feed: subscriptions or members changed.
	upWake chan struct{}

	// source is where the key's config comes from now (a sourceKind), for
	// metrics and the admin surface; the feed sets it.
	source atomic.Int32

	// demanded is the latest arrival (a ledger.Stamp) of a version some
	// client holds that the key's views cannot cover because their upstream
	// stream was opened before it: the key's source opens a new stream
	// (see demand).
	demanded atomic.Uint64
	// answersDemanded is the latest demand of a held route or listener
	// (demandAnswers): it wants every type's view from a stream opened
	// after it, which a stream that may stay silent on a type never gives.
	answersDemanded atomic.Uint64

	// hist is the ledger history of each type's view. Only the key's
	// feed (or the restore before it starts) records. held is what SotW
	// clients were sent that is no version of the view (the view with a
	// removal held back for the client's routes, or a name it lacks): a
	// client that moves claims it, and the tier's lookup of it must find
	// it (versionHeld). Both under histMu.
	histMu sync.Mutex
	hist   map[string]*ledger.History[*xds.Resource]
	held   map[ledger.Hash]ledger.Tree[*xds.Resource]
	heldQ  []ledger.Hash // held's roots, oldest first

	// claims are the key's lookups of SotW clients' claimed versions in
	// the tier (claims.go).
	claims claimTable

	// joined is len(members), and peers how many of them are other
	// relays subscribing to this key: written under mu, read by anyone
	// (metrics and reports take no key's lock).
	joined, peers atomic.Int32

	// presentedNode is the node the key's source stream presents (nil
	// before the first): what a divergence check compares with.
	presentedNode atomic.Pointer[core.Node]

	mu      sync.Mutex
	members []member // in join order; the first one's node is presented upstream
	want    map[string]*typeWant
	div     divergence.Schedule[member]
	// splitFrom is the key this one's members left by a split (a key of
	// a node of its own: aggkey.SplitKey); "" for a key of the profile.
	// Its members are checked against that key now and then, and return
	// to it once the split is merged back.
	splitFrom aggkey.Key
	// abandoned is set once a member left the key because its split was
	// merged back: nobody comes back to it, so it does not idle for
	// Keys.IdleTimeout with its upstream stream open.
	abandoned atomic.Bool
}

// name is the key's name.
func (k *keyState) name() aggkey.Key { return k.key }

// published returns the key's latest views.
func (k *keyState) published() *views.Set { return k.views.Load() }

// abandon notes that a member left the key because its split merged
// back: nobody comes back to it, so it does not idle with its source
// stream open.
func (k *keyState) abandon() { k.abandoned.Store(true) }

// claimLookups returns the key's lookups of claimed versions.
func (k *keyState) claimLookups() *claimTable { return &k.claims }

// aggregated reports whether more than one stream (Envoys, and relays the
// key is served to) is joined to the key here: its one source serves them
// all. A key whose Envoys spread over relays is aggregated at its owner
// (the relays are members there), and may not be at the others.
func (k *keyState) aggregated() bool { return k.joined.Load() > 1 }

// lone reports whether the key serves exactly one Envoy here and no other
// relay: it costs a source (an upstream or peer stream) of its own.
func (k *keyState) lone() bool { return k.joined.Load() == 1 && k.peers.Load() == 0 }

// member is what a key knows of a stream joined to it (stream.go): what its
// upstream stream presents when the member is the one presented, whether it
// is another relay, and how to tell it the views changed.
type member interface {
	// presents returns the member's node and, in forward mode, its token
	// (nil if none).
	presents() (*core.Node, *credential)
	// peerRelayID is the ID of the relay on the other end, "" for an Envoy.
	peerRelayID() string
	// viewsChanged wakes the member to look at the latest views. It never
	// blocks.
	viewsChanged()
}

// typeWant is the union of the member streams' subscriptions to one type.
//
// It holds the streams' name sets themselves (interned: streams that ask
// alike share one, keyCache.nameSets), each once with the number of streams
// subscribed to it, not a copy of their names: the Envoys of a key mostly
// ask alike, and a per-node key holds its one Envoy's set, which is every
// other key's of the same content. Only while its streams ask differently
// does it count names (counts): then a change costs the names it changes,
// not the sets' sizes times their number.
type typeWant struct {
	wildcard int          // streams subscribed to everything
	sets     []countedSet // the distinct non-empty name sets streams subscribe to
	// counts holds, while sets holds more than one, how many of them hold
	// each name.
	counts map[string]int
	// union is counts' names, sorted, once names has been asked since
	// they last changed (nil until then).
	union xds.NameSet
}

// countedSet is a name set some streams subscribe to, and how many do.
type countedSet struct {
	names   xds.NameSet
	streams int
}

// sameSet reports whether a and b are the same set: interned sets of equal
// content are one, so the first test settles it almost always.
func sameSet(a, b xds.NameSet) bool {
	if len(a) != len(b) {
		return false
	}
	return len(a) == 0 || &a[0] == &b[0] || slices.Equal(a, b)
}

// names returns the union of the streams' name sets, sorted: the one set
// itself (never to be changed) while they all ask alike.
func (w *typeWant) names() xds.NameSet {
	switch len(w.sets) {
	case 0:
		return nil
	case 1:
		return slices.Clip(w.sets[0].names)
	}
	if w.union == nil {
		w.union = slices.Sorted(maps.Keys(w.counts))
	}
	return slices.Clip(w.union)
}

// add counts one more stream subscribed to names and returns the names no
// stream wanted before.
func (w *typeWant) add(names xds.NameSet) (fresh []string) {
	if len(names) == 0 {
		return nil
	}
	if i := slices.IndexFunc(w.sets, func(c countedSet) bool { return sameSet(c.names, names) }); i >= 0 {
		w.sets[i].streams++
		return nil
	}
	switch len(w.sets) {
	case 0:
		fresh = names
	case 1:
		only := w.sets[0].names
		w.counts = make(map[string]int, len(only)+len(names))
		for _, n := range only {
			w.counts[n] = 1
		}
		fallthrough
	default:
		for _, n := range names {
			if w.counts[n] == 0 {
				fresh = append(fresh, n)
			}
			w.counts[n]++
		}
	}
	w.sets = append(w.sets, countedSet{names: names, streams: 1})
	w.union = nil
	return fresh
}

// remove counts one stream fewer subscribed to names.
func (w *typeWant) remove(names xds.NameSet) {
	i := slices.IndexFunc(w.sets, func(c countedSet) bool { return sameSet(c.names, names) })
	if i < 0 {
		return // empty: never counted
	}
	if w.sets[i].streams--; w.sets[i].streams > 0 {
		return
	}
	w.sets = slices.Delete(w.sets, i, i+1)
	w.union = nil
	if len(w.sets) <= 1 {
		w.counts = nil // the one set left is the union
		return
	}
	for _, n := range names {
		if c := w.counts[n]; c > 1 {
			w.counts[n] = c - 1
		} else {
			delete(w.counts, n)
		}
	}
}

func newKeyState(c *keyCache, key aggkey.Key) *keyState {
	k := &keyState{
		key:    key,
		c:      c,
		upWake: make(chan struct{}, 1),
		want:   make(map[string]*typeWant),
		hist:   make(map[string]*ledger.History[*xds.Resource]),
	}
	k.views.Store(&views.Set{Types: map[string]*views.Type{}})
	return k
}

// recordView enters typeURL's view, received from the key's source at at
// with Order order, into the key's ledger history.
func (k *keyState) recordView(typeURL string, view ledger.Tree[*xds.Resource], at time.Time, order ledger.Order) {
	k.histMu.Lock()
	h := k.hist[typeURL]
	if h == nil {
		var err error
		if h, err = ledger.NewHistory[*xds.Resource](k.c.cfg.History); err != nil {
			panic(err) // Config.validate checked it
		}
		k.hist[typeURL] = h
	}
	k.histMu.Unlock()
	if v, recorded := h.Record(view, at, order); recorded {
		k.c.ledger.Recorded(string(k.key), typeURL, h, v)
	}
}

// maxClaimVersions bounds the versions versionHeld goes back through for a
// subscription to some of a type's names: each costs a subset tree.
const maxClaimVersions = 32

// versionHeld returns what a client subscribed to typeURL (to everything if
// wildcard, else to names) holds if it holds the version root of the type:
// a version the key's history kept (the whole view, or the names' part of
// one of its last maxClaimVersions). The values of entries rebuilt from the
// history are nil.
func (k *keyState) versionHeld(typeURL string, wildcard bool, names xds.NameSet, root ledger.Hash) (ledger.Tree[*xds.Resource], bool) {
	k.histMu.Lock()
	h := k.hist[typeURL]
	sent, wasSent := k.held[root]
	k.histMu.Unlock()
	if wasSent {
		return sent, true
	}
	if h == nil {
		return ledger.Tree[*xds.Resource]{}, false
	}
	if wildcard {
		t, err := h.TreeAt(root) // any kept version of the whole view
		return t, err == nil
	}
	var held ledger.Tree[*xds.Resource]
	found := false
	h.Back(maxClaimVersions, func(_ ledger.Version, t ledger.Tree[*xds.Resource]) bool {
		held = partOf(t, names)
		found = held.Root() == root
		return !found
	})
	return held, found
}

// lastContent returns, of names, those one of the last maxClaimVersions
// versions of the key's history of typeURL had, each at the newest content
// the history kept of it whose body the relay's store still holds.
func (k *keyState) lastContent(typeURL string, names []string) []*xds.Resource {
	k.histMu.Lock()
	h := k.hist[typeURL]
	k.histMu.Unlock()
	if h == nil || len(names) == 0 {
		return nil
	}
	left := make(map[string]struct{}, len(names))
	for _, n := range names {
		left[n] = struct{}{}
	}
	var out []*xds.Resource
	h.Back(maxClaimVersions, func(_ ledger.Version, t ledger.Tree[*xds.Resource]) bool {
		for n := range left {
			e, ok := t.Get(n)
			if !ok {
				continue
			}
			r := e.Value
			if r == nil {
				r = k.c.store.Lookup(e.Hash)
			}
			if r != nil {
				out = append(out, r)
				delete(left, n)
			}
		}
		return len(left) > 0
	})
	return out
}

// maxHeldVersions bounds the versions a key remembers having sent SotW
// clients beside its views' (keyState.held): the few clients whose removals
// are held back at any moment.
const maxHeldVersions = 64

// sentHeld remembers that a SotW client was sent t, no version of the
// key's view of its type: a client that moves claims its root.
func (k *keyState) sentHeld(t ledger.Tree[*xds.Resource]) {
	root := t.Root()
	k.histMu.Lock()
	defer k.histMu.Unlock()
	if _, ok := k.held[root]; ok {
		return
	}
	if k.held == nil {
		k.held = make(map[ledger.Hash]ledger.Tree[*xds.Resource])
	}
	if len(k.heldQ) >= maxHeldVersions {
		delete(k.held, k.heldQ[0])
		k.heldQ = k.heldQ[1:]
	}
	k.held[root] = t
	k.heldQ = append(k.heldQ, root)
}

// partOf returns the entries of view named in names: the view itself if
// that is all of it.
func partOf(view ledger.Tree[*xds.Resource], names xds.NameSet) ledger.Tree[*xds.Resource] {
	b := ledger.Tree[*xds.Resource]{}.Edit()
	for _, n := range names {
		if e, ok := view.Get(n); ok {
			b.Set(n, e.Hash, e.Value)
		}
	}
	t := b.Tree()
	if t.Root() == view.Root() {
		return view // share the view's nodes
	}
	return t
}

// update publishes a new views.Set built by fn from a copy of the current ones.
// fn may replace entries of types, never modify a views.Type in place. The
// caller holds k.mu.
func (k *keyState) update(fn func(next *views.Set)) {
	cur := k.views.Load()
	next := &views.Set{Types: maps.Clone(cur.Types), Stale: cur.Stale, Restored: cur.Restored}
	fn(next)
	k.views.Store(next)
}

// wakeStreams tells every member stream that the views changed. It never
// blocks: a stream that is busy (a slow reader) finds the latest state when
// it comes back.
func (k *keyState) wakeStreams() {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, m := range k.members {
		m.viewsChanged()
	}
}

// demand asks the key's source for views that cover a version a client
// holds, which arrived at at on another upstream stream (ledger.Order): an
// upstream stream opened after at gives them. A relay that owns the key (or
// is in fallback) opens one; a relay that subscribes to the owner passes
// the demand on to it. From a peer relay, at moves the relay's clock (and is
// dropped if the clock refuses it); an Envoy's was checked when it declared
// it (keyCache.placed).
func (k *keyState) demand(at ledger.Stamp, fromPeer bool) {
	if fromPeer {
		if !k.c.observe(ledger.Order{Session: at, At: at}, "peer demand", string(k.key)) {
			return // its clock is off: no stream of ours can cover it
		}
	}
	for {
		cur := k.demanded.Load()
		if uint64(at) <= cur {
			return
		}
		if k.demanded.CompareAndSwap(cur, uint64(at)) {
			wake(k.upWake)
			return
		}
	}
}

// demandAnswers is demand for a held route or listener whose cluster the
// key's view lacks: the source is proven not to serve it only by every
// type's view from a stream opened after at (absentProven), so a stream
// that may stay silent on a type renews too (feed.silentBefore).
func (k *keyState) demandAnswers(at ledger.Stamp) {
	for {
		cur := k.answersDemanded.Load()
		if uint64(at) <= cur || k.answersDemanded.CompareAndSwap(cur, uint64(at)) {
			break
		}
	}
	k.demand(at, false)
}

func wake(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// join adds m as a member.
func (k *keyState) join(m member) {
	k.mu.Lock()
	k.members = append(k.members, m)
	k.abandoned.Store(false) // a split proven again brings a member back
	// joined before peers here, peers before joined in leave: a reader of
	// peers then joined never sees more peers than members.
	k.joined.Store(int32(len(k.members)))
	if m.peerRelayID() != "" {
		k.peers.Add(1)
	}
	second := len(k.members) == 2
	if second {
		// A key that just became aggregated is checked at once, with
		// the member that made it so, if this relay is its upstream
		// source (checkDue).
		k.div.Soon(m)
	}
	k.mu.Unlock()
	wake(k.upWake)
	if second {
		wake(k.c.divergenceWake)
	}
}

// servesPeers reports whether other relays subscribe to this key here: then
// this relay holds the key's upstream stream itself, whoever the ring says
// owns it, so that a relay-to-relay stream is never more than one hop and
// two relays that disagree on the owner never subscribe to each other.
func (k *keyState) servesPeers() bool { return k.peers.Load() > 0 }

// leave removes m, and the subscriptions it held, subs, by type URL.
func (k *keyState) leave(m member, subs iter.Seq2[string, subscription]) {
	k.mu.Lock()
	n := len(k.members)
	k.members = slices.DeleteFunc(k.members, func(o member) bool { return o == m })
	if m.peerRelayID() != "" && len(k.members) < n {
		k.peers.Add(-1)
	}
	k.joined.Store(int32(len(k.members)))
	k.div.Forget(m)
	for typeURL, sub := range subs {
		k.changeLocked(typeURL, sub.wildcard, false, sub.names, nil)
	}
	k.mu.Unlock()
	wake(k.upWake)
}

// presenter returns the member whose node the upstream stream presents, and
// the number of members.
func (k *keyState) presenter() (member, int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.members) == 0 {
		return nil, 0
	}
	return presentable(k.members, k.c.cfg.Upstream.ForwardCredentials, time.Now(), k.c.cfg.Upstream.TokenRefreshBefore), len(k.members)
}

// memberCount returns the number of members.
func (k *keyState) memberCount() int { return int(k.joined.Load()) }

// isMember reports whether m is still a member.
func (k *keyState) isMember(m member) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Contains(k.members, m)
}

// subscribe records a stream's subscription change to typeURL: wildcard
// turned on or off, its names moved from one set to another (both
// interned, keyCache.nameSets). Names newly wanted that the view does not
// hold become pending at once, so that no stream reports them missing
// before the upstream had a chance to send them.
func (k *keyState) subscribe(typeURL string, wildcardBefore, wildcardAfter bool, before, after xds.NameSet) {
	k.mu.Lock()
	defer k.mu.Unlock()
	fresh := k.changeLocked(typeURL, wildcardBefore, wildcardAfter, before, after)
	if len(fresh) > 0 {
		now := time.Now()
		k.update(func(next *views.Set) { next.MarkPending(typeURL, fresh, now) })
	}
	if wildcardBefore != wildcardAfter || len(fresh) > 0 || !sameSet(before, after) {
		wake(k.upWake)
	}
}

// changeLocked applies a stream's subscription change to k.want and
// returns the names that no stream wanted before. The caller holds k.mu.
func (k *keyState) changeLocked(typeURL string, wildcardBefore, wildcardAfter bool, before, after xds.NameSet) []string {
	w := k.want[typeURL]
	if w == nil {
		w = &typeWant{}
		k.want[typeURL] = w
	}
	switch {
	case wildcardAfter && !wildcardBefore:
		w.wildcard++
	case wildcardBefore && !wildcardAfter:
		w.wildcard--
	}
	var fresh []string
	if !sameSet(before, after) {
		// Added before removed: the names both sets hold stay wanted.
		fresh = w.add(after)
		w.remove(before)
	}
	if w.wildcard == 0 && len(w.sets) == 0 {
		delete(k.want, typeURL)
	}
	return fresh
}

// wanted returns the downstream subscriptions, by type. The name sets may
// be shared: nobody may change them.
func (k *keyState) wanted() map[string]subscription {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := make(map[string]subscription, len(k.want))
	for typeURL, w := range k.want {
		out[typeURL] = subscription{wildcard: w.wildcard > 0, names: w.names()}
	}
	return out
}

// subscription is a set of names to ask the upstream for.
type subscription struct {
	wildcard bool
	names    xds.NameSet
}

// wantedLocked returns the types k's members subscribe to, and whether any
// subscribes to everything of each. The caller holds k.mu.
func (k *keyState) wantedLocked() map[string]bool {
	out := make(map[string]bool, len(k.want))
	for typeURL, w := range k.want {
		out[typeURL] = w.wildcard > 0
	}
	return out
}

// wantedTypes is wantedLocked, taking k.mu.
func (k *keyState) wantedTypes() map[string]bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.wantedLocked()
}

// The key's divergence check schedule: k.div (divergence.Schedule), read
// and changed under k.mu. checks.go runs the checks.

// checkDue reports whether k's check is due now, and the member to check
// (divergence.Schedule.Due). It marks the check running; checkDone ends
// it.
func (k *keyState) checkDue(now time.Time, every time.Duration) (member, bool) {
	fromOwner := sourceKind(k.source.Load()) == sourcePeer
	if fromOwner && k.c.cfg.Upstream.ForwardCredentials {
		return nil, false // the owner would need the member's token
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	presented := k.presentedNode.Load()
	wanted := k.wantedLocked()
	if len(k.members) < 2 || presented == nil || !divergence.Comparable(k.views.Load(), wanted) {
		return nil, false // nothing to compare yet
	}
	candidate := func(m member) bool {
		node, cred := m.presents()
		if node == nil || node.GetId() == presented.GetId() {
			return false // the key's stream presents it
		}
		if fromOwner && m.peerRelayID() != "" {
			return false // another relay's stream: its relay asks
		}
		// In forward mode, the upstream wants the member's own token: a
		// relay's stream carries none.
		return !k.c.cfg.Upstream.ForwardCredentials || cred != nil
	}
	// The owner checks a key at once when it becomes aggregated, and
	// when its members come to subscribe to more; a relay it feeds
	// checks its own members in turn.
	return k.div.Due(now, every, k.members, wanted, candidate, !fromOwner, k.c.drawWait)
}

// recheckDue reports whether it is time to check again that the member of
// k, a key of a node of its own since a split (splitFrom), is given other
// config than the key it left (divergence.Schedule.RecheckDue). It marks
// the check running; recheckDone ends it.
func (k *keyState) recheckDue(now time.Time, every time.Duration) (member, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.splitFrom == "" {
		return nil, false
	}
	local := func(m member) bool {
		node, _ := m.presents()
		return node != nil && m.peerRelayID() == ""
	}
	return k.div.RecheckDue(now, every, k.members, local, k.c.drawWait)
}

// recheckDone ends k's re-check of m (divergence.Schedule.RecheckDone).
func (k *keyState) recheckDone(m member, proven bool, every time.Duration) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.div.RecheckDone(m, proven, every, time.Now())
}

// drawWait returns a random wait in [0, d), drawn from Config.Rand: a
// key's first check at a random point of its interval.
func (c *keyCache) drawWait(d time.Duration) time.Duration { return randN(c.rand, d) }

// checkLater ends k's running check of m, which could not run: m is
// checked first at the next tick (divergence.Schedule.Later).
func (k *keyState) checkLater(m member) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.div.Later(m)
}

// startCheck marks a check of k running, unless one runs: for a check
// another relay asked for, or of a member of another key. endCheck ends
// it.
func (k *keyState) startCheck() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.div.Start()
}

// endCheck ends the check startCheck began.
func (k *keyState) endCheck() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.div.End()
}

// checkDone ends k's running check of m, a member: the next is at next,
// and compared is what the members subscribed to as it began.
func (k *keyState) checkDone(m member, next time.Time, compared map[string]bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.div.Done(m, next, compared)
}

// checkedKey is a key as its divergence check reads it.
type checkedKey struct{ k *keyState }

var _ divergence.Key = checkedKey{}

func (c checkedKey) Views() *views.Set       { return c.k.views.Load() }
func (c checkedKey) Wanted() map[string]bool { return c.k.wantedTypes() }
func (c checkedKey) Presented() *core.Node   { return c.k.presentedNode.Load() }
