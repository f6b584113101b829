package relay

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"
	"unique"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/adsclient"
	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// feed feeds one key's views from its source over one ADS stream (SotW or
// Delta), presenting a live member's node: the upstream control plane when
// this relay owns the key (or cannot reach its owner), else the owner
// relay. It runs on one goroutine, the key's feed, which alone writes the
// key's views.
type feed struct {
	k   *keyState
	r   *Relay
	log func(msg string, args ...any)

	types map[string]*feedType
	// derived counts, per type, the names the key's other views point at:
	// EDS names from clusters, RDS names from listeners and scoped routes.
	// They are fetched before any Envoy asks, as Envoy would ask next.
	derived map[string]map[string]int

	// fallbackFor is the owner's address while the owner cannot be reached
	// and the key is fed by the upstream directly.
	fallbackFor string

	presented member                    // whose node the current stream presents
	idle      *time.Timer               // running while the key has no members
	expiry    *time.Timer               // next expiry of a pending name
	send      func(proto.Message) error // queues a request on the current stream (adsclient.Stream.Send)
	delta     bool

	// sessionAt is the relay's clock when the current upstream stream was
	// opened (the Session of the views it brings: ledger.Order), opened
	// the same in wall-clock time. demandSent is the latest demand passed
	// on to the owner (keyState.demand), and demandCarried the one the
	// current stream to it carries: passed on once the owner answers that
	// stream (it read the demand before it answered). A stream that ends
	// unanswered (the owner frozen, gone, or left before it read the
	// stream) passed nothing, and the next stream carries the demand again.
	sessionAt     ledger.Stamp
	opened        time.Time
	demandSent    ledger.Stamp
	demandCarried ledger.Stamp
	// renewing is set while the current stream renews one that could not
	// cover what a client holds: it must get an answer to every type.
	renewing bool
	// ownerStale is set while the owner this relay subscribes to says its
	// views are stale (wire.MarkStale): then so are this relay's.
	ownerStale bool
}

// feedType is the feed's state of one type.
type feedType struct {
	// What was asked for; asked is reset on reconnect, so that it is asked
	// again on the new stream.
	asked    bool
	wildcard bool
	names    xds.NameSet
	nonce    string // the latest response's nonce on the current stream
	named    bool   // SotW: the current stream has sent names for the type
	answered bool   // SotW: the current stream has answered the type
	// Kept across reconnects: the last ACKed SotW version, and the
	// upstream's Delta version of each resource (for
	// initial_resource_versions), set (versionsSet) once anything was
	// declared or received. The versions are a persistent tree shared by
	// content (Relay.versionTrees): the keys of a namespace get the same
	// versions for the same resources, and hold them once.
	acked       string
	versions    ledger.Tree[string]
	versionsSet bool
	// declare, until the type is first asked for, is a restored view to
	// declare as its versions (see seedRestored).
	declare ledger.Tree[*xds.Resource]
}

var (
	errRehome        = errors.New("relay: presented member left")
	errIdle          = errors.New("relay: key idle")
	errResubscribe   = errors.New("relay: a type became wildcard")
	errSourceChanged = errors.New("relay: the key's source changed")
	errRenew         = errors.New("relay: a client holds a version this stream cannot cover")
)

// sourceKind says where a key's config comes from.
type sourceKind int32

const (
	// sourceUpstream: the relay owns the key (or serves it to peers) and
	// holds its upstream stream.
	sourceUpstream sourceKind = iota
	// sourcePeer: another relay owns the key; this one subscribes to it.
	sourcePeer
	// sourceFallback: the owner cannot be reached; the relay holds an
	// upstream stream itself until it can.
	sourceFallback
)

func (k sourceKind) String() string {
	switch k {
	case sourcePeer:
		return "peer"
	case sourceFallback:
		return "fallback"
	}
	return "upstream"
}

// source is a key's source: a kind, and the owner's address unless the
// relay owns the key.
type source struct {
	kind sourceKind
	addr string
}

// peerRetryInterval is how often a key in fallback checks whether its owner
// is reachable again.
const peerRetryInterval = 2 * time.Second

// A session whose key moved to another owner goes on until the new owner can
// be reached, checked every switchRetryInterval, for at most switchPatience.
const (
	switchRetryInterval = 100 * time.Millisecond
	switchPatience      = 3 * time.Second
)

// choose returns the key's source now: the upstream if the relay owns the
// key or other relays subscribe to it here; else the owner, unless the owner
// was unreachable and still is.
func (u *feed) choose() source {
	owners := u.r.cfg.Owners
	if owners == nil || u.k.servesPeers() {
		return source{kind: sourceUpstream}
	}
	addr, self := owners.Owner(string(u.k.key))
	if self {
		u.fallbackFor = ""
		return source{kind: sourceUpstream}
	}
	if addr == u.fallbackFor {
		if !u.r.pool.Ready(addr) {
			return source{kind: sourceFallback, addr: addr}
		}
		u.fallbackFor = ""
		u.r.log.Info("owner reachable again: subscribing to it", "key", u.k.key, "owner", addr)
	}
	return source{kind: sourcePeer, addr: addr}
}

// fallBack notes that the owner at addr failed the key: until it can be
// reached again, the key is fed by the upstream directly. If the ring moved
// the key meanwhile, the next choice follows the ring instead.
func (u *feed) fallBack(addr string, err error) {
	if now, self := u.r.cfg.Owners.Owner(string(u.k.key)); self || now != addr {
		return
	}
	u.fallbackFor = addr
	u.r.metrics.peerFallbacks.Inc()
	u.r.log.Warn("owner unreachable: subscribing to the upstream directly", "key", u.k.key, "owner", addr, "err", err)
}

func newFeed(k *keyState) *feed {
	return &feed{
		k:       k,
		r:       k.r,
		types:   make(map[string]*feedType),
		derived: make(map[string]map[string]int),
		delta:   k.r.cfg.UpstreamProtocol == ProtocolDelta,
		log: func(msg string, args ...any) {
			k.r.log.Debug(msg, append([]any{"key", k.key}, args...)...)
		},
	}
}

// run keeps an upstream stream open for the key until ctx ends or the key
// has had no members for KeyIdleTimeout.
func (u *feed) run(ctx context.Context) {
	defer u.stopTimers()
	bo := u.r.newBackoff()
	for ctx.Err() == nil {
		presenter, _ := u.k.presenter()
		node := memberNode(presenter)
		if node == nil {
			node = memberNode(u.presented)
		}
		if node == nil {
			// No member ever presented a node: wait for one.
			if !u.waitForMember(ctx) {
				return
			}
			continue
		}
		src := u.choose()
		if u.r.cfg.ForwardCredentials && src.kind != sourcePeer && !presentsToken(presenter) {
			// Forward mode: istiod takes a stream only with a member's own
			// token, and none is left to present (the members left, or
			// istiod refused their tokens). A stream without one would
			// only be refused, again and again: wait for an Envoy that
			// brings one, serving the cache meanwhile.
			if !u.waitForToken(ctx, node) {
				return
			}
			continue
		}
		u.k.source.Store(int32(src.kind))
		u.reportSource()
		got, err := u.session(ctx, node, presenter, src)
		u.renewing = errors.Is(err, errRenew)
		if u.r.cfg.ForwardCredentials && src.kind != sourcePeer && noteRefused(presenter, err) {
			u.r.log.Warn("upstream refused the token a key's stream presented: presenting another member's next", "key", u.k.key, "node", node.GetId(), "err", err)
		}
		if errors.Is(err, errIdle) || ctx.Err() != nil {
			return
		}
		// Until the next stream has answered, nobody confirms the views.
		u.setStale(true)
		switch {
		case errors.Is(err, errRehome) || errors.Is(err, errResubscribe) || errors.Is(err, errSourceChanged) || errors.Is(err, errRenew) || errors.Is(err, errSplitsTold):
			continue // a new stream at once, no backoff
		case src.kind == sourcePeer:
			u.fallBack(src.addr, err)
			continue // the upstream is another server: no backoff
		}
		if got {
			bo.reset()
		}
		d := bo.next()
		u.r.log.Warn("upstream stream failed", "key", u.k.key, "err", err, "retry_in", d.Round(time.Millisecond))
		u.r.metrics.upstreamReconnects.Inc()
		if !u.sleep(ctx, d) {
			return
		}
	}
}

// memberNode returns m's node, nil for no member.
func memberNode(m member) *core.Node {
	if m == nil {
		return nil
	}
	node, _ := m.presents()
	return node
}

// presentsToken reports whether m, in forward mode, has a token the
// upstream may still take.
func presentsToken(m member) bool {
	if m == nil {
		return false
	}
	_, cred := m.presents()
	return cred.usableAt(time.Now())
}

// waitForToken waits, in forward mode, until a member has a token to
// present (a member joins: upWake) or the key's source becomes its owner,
// or gives up when the key stays idle.
// The key's views are not confirmed meanwhile.
func (u *feed) waitForToken(ctx context.Context, node *core.Node) bool {
	u.setStale(true)
	u.r.metrics.awaitingToken.Inc()
	defer u.r.metrics.awaitingToken.Dec()
	u.r.log.Warn("forward mode: no member of the key holds a token the upstream would take; serving the cache until an Envoy brings one", "key", u.k.key, "node", node.GetId())
	return u.waitUntil(ctx, func() bool {
		first, _ := u.k.presenter()
		return presentsToken(first) || u.choose().kind == sourcePeer // a token, or a source that needs none (the owner)
	})
}

// waitForMember waits until the key has a member, or gives up when it stays
// idle.
func (u *feed) waitForMember(ctx context.Context) bool {
	return u.waitUntil(ctx, func() bool { return u.k.memberCount() > 0 })
}

// waitUntil waits until ready, asked again whenever the key's members or
// subscriptions change (upWake), and reports true; or false when ctx ends
// or the key, idle, is dropped.
func (u *feed) waitUntil(ctx context.Context, ready func() bool) bool {
	for !ready() {
		u.checkIdle()
		select {
		case <-ctx.Done():
			return false
		case <-u.k.upWake:
		case <-u.idleC():
			u.idle = nil // spent: checkIdle arms a new one if still idle
			if u.r.dropIfIdle(u.k) {
				return false
			}
		}
	}
	return true
}

// sleep waits d, or less if the key is dropped or ctx ends. It reports
// whether to go on.
func (u *feed) sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		u.checkIdle()
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
			return true
		case <-u.k.upWake:
		case <-u.idleC():
			u.idle = nil // spent: checkIdle arms a new one if still idle
			if u.r.dropIfIdle(u.k) {
				return false
			}
		}
	}
}

// session runs one upstream stream. got reports whether any response
// arrived.
func (u *feed) session(ctx context.Context, node *core.Node, presenter member, src source) (got bool, err error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The upstream's pace of new streams (Config.UpstreamStreamRate): taken
	// before a slot, so that no slot waits on it.
	if src.kind != sourcePeer && u.r.upstreamRate != nil && !u.r.upstreamRate.Allow() {
		u.r.metrics.upstreamWaiting.Inc()
		u.r.metrics.waitingOpen.Add(1)
		err := u.r.upstreamRate.Wait(ctx)
		u.r.metrics.waitingOpen.Add(-1)
		u.r.metrics.upstreamWaiting.Dec()
		if err != nil {
			return false, ctx.Err()
		}
	}
	// A slot of the relay's first answers (Config.UpstreamSyncs), held
	// until the stream answered every type or for syncSlotHold at most.
	// Streams to keys' owners take theirs from a pool of their own: an
	// owner's first answer waits on the owner's upstream stream, which must
	// never wait behind streams to other owners, or relays whose slots all
	// hold streams to each other wait on each other until syncSlotHold.
	slots := u.r.syncs
	if src.kind == sourcePeer {
		slots = u.r.peerSyncs
	}
	release, ok := slots.acquire(ctx)
	if !ok {
		return false, ctx.Err()
	}
	defer release()
	// The slot goes back at the first of: every type answered; a pause of
	// confirmAfter in the answers once some came (the first answers come
	// as a burst); confirmAfter of silence from a source that may rightly
	// say nothing (mayBeSilent); syncSlotHold.
	slotHeld := time.NewTimer(syncSlotHold)
	defer slotHeld.Stop()
	slotQuiet := time.NewTimer(confirmAfter)
	defer slotQuiet.Stop()
	up, err := u.open(sctx, node, presenter, src)
	if err != nil {
		return false, err
	}
	defer up.Close()
	u.send = up.Send
	defer u.countStream(src)()
	u.begin(presenter)
	u.k.presentedNode.Store(node)
	presentedNode := node
	u.log("upstream stream open", "node", node.GetId(), "source", src.kind, "owner", src.addr)
	// retry ticks while the key is in fallback (is the owner back?) or a
	// switch of source waits for the new source to be reachable.
	retryTicker := time.NewTicker(peerRetryInterval)
	defer retryTicker.Stop()
	var retry <-chan time.Time
	if src.kind == sourceFallback {
		retry = retryTicker.C
	}
	var switchSince time.Time // when a switch was first wanted but put off
	// switchNow reports whether to end this session for the key's new
	// source: make before break, the session goes on until the new source
	// can be reached (or for switchPatience, after which the new source is
	// tried anyway and falls back if it fails).
	switchNow := func() bool {
		next := u.choose()
		if next == src {
			switchSince = time.Time{}
			return false
		}
		if next.kind == sourcePeer && !u.r.pool.Ready(next.addr) {
			if switchSince.IsZero() {
				switchSince = time.Now()
			}
			if time.Since(switchSince) < switchPatience {
				retryTicker.Reset(switchRetryInterval)
				retry = retryTicker.C
				return false
			}
		}
		u.log("switching source", "from", src.kind, "to", next.kind, "owner", next.addr)
		return true
	}

	if err := u.resubscribe(); err != nil {
		return false, err
	}
	u.renewing = false // the first requests asked for answers
	// The views are confirmed (the key is fresh, for the admin API, the
	// metrics and persistence) once the stream answered every type it was
	// asked. A Delta upstream is made to answer every type (deltaSubscribe
	// declares one resource at a version no server has); a SotW upstream
	// may stay silent when nothing changed, and so may an owner whose view
	// is older than what this relay holds: their silence confirms after
	// confirmAfter. Confirmation orders nothing: every view carries its
	// Order, and clients are served by it (stream.sync).
	answered := make(map[string]bool)
	confirmed := false
	var renewAt <-chan time.Time // a renewal put off (renewAfter)
	renew := func() bool {
		wait, now := u.renewal(src)
		if !now && wait > 0 && renewAt == nil {
			renewAt = time.After(wait)
		}
		return now
	}
	refresh := u.refreshTimer(presenter)
	if refresh != nil {
		defer refresh.Stop()
	}
	var confirm <-chan time.Time
	if src.kind == sourcePeer || !u.delta {
		confirmTimer := time.NewTimer(confirmAfter)
		defer confirmTimer.Stop()
		confirm = confirmTimer.C
	}
	if renew() { // a demand this stream cannot cover either
		return false, errRenew
	}
	for {
		select {
		case m := <-up.Responses():
			if !got && src.kind == sourcePeer {
				if md, err := up.Header(); err == nil { // sent before the first response
					u.readSplits(md)
				}
			}
			got = true
			u.demandSent = max(u.demandSent, u.demandCarried)
			slotQuiet.Reset(confirmAfter)
			if err := u.handle(m); err != nil {
				return got, err
			}
			answered[m.GetTypeUrl()] = true
			if !confirmed && u.allAnswered(answered) {
				confirmed, confirm = true, nil
				release()
			}
			if confirmed {
				u.setStale(u.ownerStale) // an owner's views may go stale and back
			}
		case <-confirm:
			confirm = nil
			if !confirmed {
				u.r.metrics.silentConfirms.Inc()
				u.setStale(u.ownerStale)
				confirmed = true
			}
		case <-slotQuiet.C:
			if got || u.mayBeSilent(src) {
				release() // the burst is over, or none is owed
			}
		case <-slotHeld.C:
			release() // a source slow to answer does not hold up the others' keys
		case err := <-up.Err():
			if src.kind == sourcePeer {
				return got, u.ownerEnded(up, err)
			}
			return got, err
		case <-retry:
			if switchNow() {
				return got, errSourceChanged
			}
		case <-renewAt:
			renewAt = nil
			if renew() {
				return got, errRenew
			}
		case <-u.k.upWake:
			if switchNow() {
				return got, errSourceChanged
			}
			if renew() {
				return got, errRenew
			}
			first, n := u.k.presenter()
			if n > 0 && first != u.presented && (!u.k.isMember(u.presented) || u.tokenExpiring(first)) {
				u.log("re-homing upstream stream", "from", presentedNode.GetId(), "to", memberNode(first).GetId())
				return got, errRehome
			}
			u.checkIdle()
			if err := u.resubscribe(); err != nil {
				return got, err
			}
			u.armExpiry() // streams may have added pending names
		case <-u.idleC():
			u.idle = nil // spent: checkIdle arms a new one if still idle
			if u.r.dropIfIdle(u.k) {
				return got, errIdle
			}
		case <-u.expiryC():
			u.expirePending()
		case <-timerC(refresh):
			refresh = nil
			if first, n := u.k.presenter(); n > 0 && first != u.presented && u.tokenExpiring(first) {
				u.log("re-homing upstream stream: its token expires", "from", presentedNode.GetId(), "to", memberNode(first).GetId())
				return got, errRehome
			}
		case <-ctx.Done():
			return got, ctx.Err()
		}
	}
}

// refreshTimer fires TokenRefreshBefore ahead of the expiry of the token
// the stream presents (forward mode): then a member whose token lives
// longer takes over. Nil if there is nothing to refresh.
func (u *feed) refreshTimer(presenter member) *time.Timer {
	if !u.r.cfg.ForwardCredentials || presenter == nil {
		return nil
	}
	_, cred := presenter.presents()
	if cred == nil || cred.expires.IsZero() {
		return nil
	}
	return time.NewTimer(time.Until(cred.expires.Add(-u.r.cfg.TokenRefreshBefore)))
}

// tokenExpiring reports whether, in forward mode, the presented token is
// within TokenRefreshBefore of its expiry while next's lives past it: the
// stream should move to next before istiod would refuse a reconnect.
func (u *feed) tokenExpiring(next member) bool {
	if !u.r.cfg.ForwardCredentials || u.presented == nil {
		return false
	}
	horizon := time.Now().Add(u.r.cfg.TokenRefreshBefore)
	_, cur := u.presented.presents()
	_, nextCred := next.presents()
	return !cur.usableAt(horizon) && nextCred.usableAt(horizon)
}

// timerC is t's channel, or nil (never ready) for a nil timer.
func timerC(t *time.Timer) <-chan time.Time {
	if t == nil {
		return nil
	}
	return t.C
}

// open opens the session's stream on its source, presenting node: the
// upstream's connection, or the owner's (with the peer metadata, the
// demand to pass on, and the views declared, relays speaking Delta to each
// other), with the presented member's token in forward mode. Responses are
// read lazily (wire.DeltaIn, wire.SotWIn): a resource's bytes are parsed,
// and copied, only if the relay lacks the content.
func (u *feed) open(sctx context.Context, node *core.Node, presenter member, src source) (*adsclient.Stream, error) {
	conn := u.r.upConn
	u.delta = u.r.cfg.UpstreamProtocol == ProtocolDelta
	u.demandCarried = 0
	if src.kind == sourcePeer {
		var err error
		if conn, err = u.r.pool.Conn(src.addr); err != nil {
			return nil, fmt.Errorf("owner %s: %w", src.addr, err)
		}
		sctx = u.r.peerContext(sctx, u.k.key)
		if d := ledger.Stamp(u.k.demanded.Load()); d > u.demandSent {
			sctx = metadata.AppendToOutgoingContext(sctx, peers.MDDemand, d.String())
			u.demandCarried = d
		}
		// Relays speak Delta to each other, and their versions are content
		// hashes: declaring the views makes the owner send only what
		// differs, so a switch of source re-sends nothing unchanged.
		u.delta = true
		u.declareViews()
	}
	if u.r.cfg.ForwardCredentials && presenter != nil {
		// The member's own token: istiod checks it against the node this
		// stream presents, which is that member's.
		_, cred := presenter.presents()
		sctx = withCredential(sctx, cred)
	}
	return adsclient.Open(sctx, conn, adsclient.Config{Delta: u.delta, Node: node, MaxQueued: maxQueuedRequests})
}

// countStream counts the session's stream as open, by source, until the
// returned func is called.
func (u *feed) countStream(src source) (uncount func()) {
	if src.kind == sourcePeer {
		u.r.metrics.peerStreams.Inc()
		u.r.metrics.peerOpen.Add(1)
		return func() {
			u.r.metrics.peerStreams.Dec()
			u.r.metrics.peerOpen.Add(-1)
		}
	}
	u.r.metrics.upstreamStreams.Inc()
	u.r.metrics.upstreamOpen.Add(1)
	return func() {
		u.r.metrics.upstreamStreams.Dec()
		u.r.metrics.upstreamOpen.Add(-1)
	}
}

// begin resets the per-stream state for a new session presenting
// presenter's node: every type is asked again, and the session's Order
// starts now.
func (u *feed) begin(presenter member) {
	u.presented, u.ownerStale = presenter, false
	// Opened before anything is asked: every answer on this stream is at
	// least as new as the upstream was now, which is a later millisecond
	// than anything the relay saw before (so the stream covers it).
	// Its counter is drawn at random: another relay's stream for the key
	// opened in the same millisecond has another Session (not SameStream).
	u.sessionAt, u.opened = u.r.clock.Later(sessionStampWait, uint16(randN(u.r.rand, int64(1<<15)))), time.Now()
	for _, ut := range u.types {
		ut.asked, ut.nonce, ut.named, ut.answered = false, "", false, false // what it was asked is asked again
	}
}

// sessionStampWait bounds the wait of a new upstream stream for its
// Session to read a millisecond after all the relay saw (ledger.Clock.Later):
// a millisecond, but for a relay that observed a faster clock's Stamps.
const sessionStampWait = 10 * time.Millisecond

// renewAfter is how long an upstream or peer stream lives at least before
// a client's demand renews it: a bound on the reconnects that clients (each
// of which may declare anything) can cause, one a second per key.
const renewAfter = time.Second

// renewal reports whether to end the session for a new one that covers what
// clients demanded (keyState.demand): at once (now), or after wait. A relay
// that subscribes to the owner renews its stream to pass the demand on.
func (u *feed) renewal(src source) (wait time.Duration, now bool) {
	d := ledger.Stamp(u.k.demanded.Load())
	switch {
	case src.kind == sourcePeer && d <= max(u.demandSent, u.demandCarried):
		return 0, false // passed on already, or on its way
	case src.kind != sourcePeer && d.Before(u.sessionAt): // as Covers wants
		return 0, false // the current stream was opened after it
	}
	if left := renewAfter - time.Since(u.opened); left > 0 {
		return left, false
	}
	u.log("renewing upstream stream: a client holds a version it cannot cover", "arrived", d.String())
	return 0, true
}

// declareViews sets, for every type, the versions a new Delta stream
// declares to what the key's views hold: the relay's content hashes and
// the views' Orders, which a peer relay recognises and orders.
func (u *feed) declareViews() {
	snap := u.k.views.Load()
	for typeURL, ut := range u.types {
		ts := snap.types[typeURL]
		var view ledger.Tree[*xds.Resource]
		var order ledger.Order
		if ts != nil {
			view, order = ts.view, ts.order
		}
		u.setVersions(ut, versionTreeOf(view, func(h ledger.Hash) string { return wire.Version(h, order) }))
	}
}

// setVersions makes b the versions of ut, shared with the keys that hold
// the same (Relay.versionTrees).
func (u *feed) setVersions(ut *feedType, b *ledger.Builder[string]) {
	ut.versions, ut.versionsSet = u.r.versionTrees.Intern(b.Tree()), true
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
// streams subscribe to, plus the names the key's views point at.
func (u *feed) desired() map[string]subscription {
	want := u.k.wanted()
	for typeURL, names := range u.derived {
		if len(names) == 0 {
			continue
		}
		w := want[typeURL]
		w.names = w.names.With(slices.Collect(maps.Keys(names)), nil)
		want[typeURL] = w
	}
	return want
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
		// Shared by content: per-node keys of one view ask for one set.
		names := u.r.nameSets.Intern(w.names)
		if ut.asked && ut.wildcard == w.wildcard && sameSet(ut.names, names) {
			continue
		}
		if ut.asked && w.wildcard && !ut.wildcard {
			// Turning a named subscription into a wildcard on a live stream,
			// the next response may still answer the named one: nothing
			// says when the view becomes the full set. A new stream asks
			// for the wildcard from its first request.
			return errResubscribe
		}
		if !w.wildcard {
			u.dropUnwanted(typeURL, names)
			u.notFull(typeURL)
		}
		var req proto.Message
		if u.delta {
			req = u.deltaSubscribe(typeURL, ut, w.wildcard, names)
		} else {
			req = u.sotwRequest(typeURL, ut, w.wildcard, names, nil)
			if u.renewing {
				// A SotW upstream answers a stream's first request only
				// if its version differs from the one reported: a renewal
				// needs the answers.
				req.(*discovery.DiscoveryRequest).VersionInfo = ""
			}
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
	if ts := u.k.views.Load().types[typeURL]; ts != nil && ts.full {
		u.k.update(func(next *keyViews) {
			c := next.typeOf(typeURL)
			c.full = false
			next.types[typeURL] = c
		})
	}
}

// dropUnwanted removes from a view the names nobody asks for any more.
func (u *feed) dropUnwanted(typeURL string, names xds.NameSet) {
	ts := u.k.views.Load().types[typeURL]
	if ts == nil {
		return
	}
	var drop []string
	for e := range ts.view.All() {
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
	var rn []string
	switch {
	case wildcard && len(names) == 0 && !ut.named:
		// The legacy wildcard, the most widely understood form; it means
		// wildcard only while the stream never named anything for the type.
	case wildcard:
		rn = append([]string{xds.WildcardName}, names...)
	default:
		rn = names
	}
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
		return u.r.store.Decode(typeURL, resp.Resources[i], "")
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
		gone = namesNotIn(u.k.views.Load().types[typeURL], upd)
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
		return u.r.store.Decode(typeURL, res[i].Body, res[i].Name)
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
	u.r.metrics.upstreamNACKs.WithLabelValues(xds.ShortType(typeURL)).Inc()
	u.r.log.Warn("upstream response refused", "key", u.k.key, "type", xds.ShortType(typeURL), "version", version, "err", cause)
	detail := &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: cause.Error()}
	if u.delta {
		return u.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResponseNonce: nonce, ErrorDetail: detail})
	}
	return u.send(u.sotwRequest(typeURL, ut, ut.wildcard, ut.names, detail))
}

// arrived returns the Order of a view the upstream just sent on the current
// stream.
func (u *feed) arrived() ledger.Order {
	return ledger.Order{Session: u.sessionAt, At: u.r.clock.Now()}
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
	u.r.observe(o, "owner", string(u.k.key))
	return o
}

// apply publishes a new view of typeURL: upd set, del removed, and with
// replace everything else removed too (a SotW full-state response). A view
// from the key's source (fromSource) has order and marks the type ready;
// otherwise (the relay itself dropped names nobody asks for) the view keeps
// its Order. A Mixed order from the owner (it sent part of its view: see
// stream.emit) leaves the view holding parts of the old one: its Order is
// the mix of both.
func (u *feed) apply(typeURL string, upd []*xds.Resource, del []string, replace, fromSource bool, order ledger.Order) {
	k := u.k
	received := time.Now()
	k.mu.Lock()
	var derivedChanged bool
	var view ledger.Tree[*xds.Resource]
	var viewOrder ledger.Order
	var gone []*xds.Resource // what the view dropped, kept a while (Relay.dropped)
	k.update(func(next *keyViews) {
		ts := next.typeOf(typeURL)
		old := ts.view
		b := old.Edit()
		if replace {
			keep := make(map[string]struct{}, len(upd))
			for _, r := range upd {
				keep[r.Name] = struct{}{}
			}
			for e := range old.All() {
				if _, ok := keep[e.Name]; !ok {
					b.Delete(e.Name)
					gone = append(gone, e.Value)
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
			}
			b.Delete(n)
		}
		ts.view = u.r.views.Intern(b.Tree())
		if fromSource {
			if order.Mixed && old.Len() > 0 {
				order = ts.order.Mix(order)
			}
			ts.ready, ts.order = true, order
		}
		// The view is the full set only once the upstream answered a
		// wildcard subscription.
		ts.full = u.types[typeURL].wildcard && (fromSource || ts.full)
		ts.pending = withoutArrived(ts.pending, upd)
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
			ts.pending = withPending(ts.pending, stillWanted(u.types[typeURL], del), received)
		}
		next.types[typeURL] = ts
		derivedChanged = u.follow(next, typeURL, old, ts.view)
		view, viewOrder = ts.view, ts.order
	})
	k.mu.Unlock()
	k.r.dropped.Keep(gone)
	k.recordView(typeURL, view, received, viewOrder)
	k.wakeStreams()
	if derivedChanged {
		wake(k.upWake) // ask the upstream for the names the new view points at
	}
	u.armExpiry()
	if fromSource {
		u.r.persist(u.k)
	}
}

// namesNotIn returns the names ts's view holds that upd does not.
func namesNotIn(ts *typeView, upd []*xds.Resource) []string {
	if ts == nil || ts.view.Len() == 0 {
		return nil
	}
	in := make(map[string]struct{}, len(upd))
	for _, r := range upd {
		in[r.Name] = struct{}{}
	}
	var out []string
	for e := range ts.view.All() {
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
func (u *feed) follow(next *keyViews, typeURL string, old, cur ledger.Tree[*xds.Resource]) bool {
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
func (u *feed) followEdge(next *keyViews, target string, kind xds.RefKind, old, cur ledger.Tree[*xds.Resource]) bool {
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
	next.markPending(target, added, time.Now())
	return changed
}

// armExpiry sets the timer for the earliest pending name to expire.
func (u *feed) armExpiry() {
	var earliest time.Time
	for _, ts := range u.k.views.Load().types {
		for _, at := range ts.pending {
			if earliest.IsZero() || at.Before(earliest) {
				earliest = at
			}
		}
	}
	if earliest.IsZero() {
		return
	}
	d := time.Until(earliest.Add(u.r.cfg.ResourceWaitTimeout))
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
	wait := u.r.cfg.ResourceWaitTimeout
	k := u.k
	k.mu.Lock()
	k.update(func(next *keyViews) {
		for typeURL, ts := range next.types {
			var keep map[string]time.Time
			changed := false
			for n, at := range ts.pending {
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
				c.pending = keep
				next.types[typeURL] = &c
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
		wait := u.r.cfg.KeyIdleTimeout
		if u.r.nobodyComesBack(u.k) {
			wait = 0
		}
		u.idle = time.NewTimer(wait)
	case n == 0 && u.r.nobodyComesBack(u.k):
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

// probeVersion is declared for one resource of each type on a new Delta
// upstream stream: no server holds it, so the server sends that resource.
const probeVersion = "meshrelay-probe"

// confirmAfter is how long a SotW upstream or a peer relay may stay silent
// on a new stream before its silence confirms the views.
const confirmAfter = 2 * time.Second

// mayBeSilent reports whether the current stream's source may rightly
// not answer at all: a SotW upstream told the version the relay holds of
// every type it asked for (its answer would repeat it). An owner answers
// its peers on every type, a Delta upstream is made to (deltaSubscribe's
// probe), and an upstream that was told of no version owes a first answer.
func (u *feed) mayBeSilent(src source) bool {
	if src.kind == sourcePeer {
		return false
	}
	for typeURL, ut := range u.types {
		if ut.asked && ut.acked == "" && !xds.Silent(typeURL) {
			return false
		}
	}
	return true
}

// syncSlotHold bounds how long a stream holds a slot of the relay's first
// answers (syncSlots) without having answered every type.
const syncSlotHold = 30 * time.Second

// syncSlots bounds the streams to keys' sources that are open and have not
// answered every type yet (Config.UpstreamSyncs): a stream's first answers
// carry its key's whole config, decoded as they arrive, and a relay that
// starts cold, or a tier whose istiod restarted, would otherwise receive
// every key's at once and hold them all at once. Nil: no bound. Safe for
// concurrent use.
type syncSlots chan struct{}

func newSyncSlots(n int) syncSlots {
	if n <= 0 {
		return nil
	}
	return make(syncSlots, n)
}

// acquire takes a slot, waiting for one until ctx ends (ok false). release
// gives it back; calling it again does nothing.
// tryAcquire takes a slot if one is free now.
func (s syncSlots) tryAcquire() (release func(), ok bool) {
	if s == nil {
		return func() {}, true
	}
	select {
	case s <- struct{}{}:
	default:
		return nil, false
	}
	var once sync.Once
	return func() { once.Do(func() { <-s }) }, true
}

func (s syncSlots) acquire(ctx context.Context) (release func(), ok bool) {
	if s == nil {
		return func() {}, true
	}
	select {
	case s <- struct{}{}:
	case <-ctx.Done():
		return nil, false
	}
	var once sync.Once
	return func() { once.Do(func() { <-s }) }, true
}

// allAnswered reports whether every type asked on the stream was answered,
// but those an upstream may never answer (xds.Silent).
func (u *feed) allAnswered(answered map[string]bool) bool {
	for typeURL, ut := range u.types {
		if ut.asked && !answered[typeURL] && !xds.Silent(typeURL) {
			return false
		}
	}
	return true
}

// setStale marks the key's views as confirmed by a live source or not (for
// operators, for persistence, and for clients that declared content without
// an Order, which only a live view replaces: they are woken).
func (u *feed) setStale(stale bool) {
	k := u.k
	k.mu.Lock()
	cur := k.views.Load()
	changed := cur.stale != stale || (!stale && cur.restored)
	if changed {
		k.update(func(next *keyViews) {
			next.stale = stale
			if !stale {
				next.restored = false // a live source confirmed the views
			}
		})
	}
	k.mu.Unlock()
	if changed {
		u.reportSource()
		u.log("views confirmed by a live source", "fresh", !stale)
		k.wakeStreams()
	}
	if changed && !stale {
		u.r.persist(u.k)
	}
}

// reportSource tells the ledger where the key's views come from now.
func (u *feed) reportSource() {
	k := u.k
	src := ledger.SourcePeer
	switch sourceKind(k.source.Load()) {
	case sourceUpstream:
		src = ledger.SourceUpstream
	case sourceFallback:
		src = ledger.SourceFallback
	}
	k.r.ledger.SetSource(string(k.key), src, k.views.Load().stale)
	k.r.reportSplits(k.key)
}
