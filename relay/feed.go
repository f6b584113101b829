package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/adsclient"
	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// feed feeds one key's views from its source over one ADS stream (SotW or
// Delta), presenting a live member's node: the upstream control plane when
// this relay owns the key (or cannot reach its owner), else the owner
// relay. It runs on one goroutine, the key's feed, which alone writes the
// key's views.
type feed struct {
	k   *keyState
	c   *keyCache
	log func(msg string, args ...any)

	types map[string]*feedType
	// derived counts, per type, the names the key's other views point at:
	// EDS names from clusters, RDS names from listeners and scoped routes.
	// They are fetched before any Envoy asks, as Envoy would ask next.
	derived map[string]map[string]int
	// derivedSets holds derived's names of a type as a set, built when
	// desired first needs it after they changed (followEdge and
	// followRestored drop it then): every member's request recomputes
	// what to ask.
	derivedSets map[string]xds.NameSet

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
	// told is set (SotW) when the current stream's first request of the
	// type carried a version: a server that holds that version may never
	// answer it (silentBefore).
	told bool
	// Kept across reconnects: the last ACKed SotW version, and the
	// upstream's Delta version of each resource (for
	// initial_resource_versions), set (versionsSet) once anything was
	// declared or received. The versions are a persistent tree shared by
	// content (keyCache.versionTrees): the keys of a namespace get the same
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

// choose returns the key's source now: the upstream if the relay owns the
// key or other relays subscribe to it here; else the owner, unless the owner
// was unreachable and still is.
func (u *feed) choose() source {
	owners := u.c.cfg.Owners
	if owners == nil || u.k.servesPeers() {
		return source{kind: sourceUpstream}
	}
	addr, self := owners.Owner(string(u.k.key))
	if self {
		u.fallbackFor = ""
		return source{kind: sourceUpstream}
	}
	if addr == u.fallbackFor {
		if !u.ownerReady(addr) {
			return source{kind: sourceFallback, addr: addr}
		}
		u.fallbackFor = ""
		u.c.log.Info("owner reachable again: subscribing to it", "key", u.k.key, "owner", addr)
	}
	return source{kind: sourcePeer, addr: addr}
}

// fallBack notes that the owner at addr failed the key: until it can be
// reached again, the key is fed by the upstream directly. If the ring moved
// the key meanwhile, the next choice follows the ring instead.
func (u *feed) fallBack(addr string, err error) {
	if now, self := u.c.cfg.Owners.Owner(string(u.k.key)); self || now != addr {
		return
	}
	u.fallbackFor = addr
	u.c.metrics.PeerFallbacks.Inc()
	u.c.log.Warn("owner unreachable: subscribing to the upstream directly", "key", u.k.key, "owner", addr, "err", err)
}

func newFeed(k *keyState) *feed {
	return &feed{
		k:           k,
		c:           k.c,
		types:       make(map[string]*feedType),
		derived:     make(map[string]map[string]int),
		derivedSets: make(map[string]xds.NameSet),
		delta:       k.c.cfg.Upstream.Protocol == ProtocolDelta,
		log: func(msg string, args ...any) {
			k.c.log.Debug(msg, append([]any{"key", k.key}, args...)...)
		},
	}
}

// run keeps an upstream stream open for the key until ctx ends or the key
// has had no members for Keys.IdleTimeout.
func (u *feed) run(ctx context.Context) {
	defer u.stopTimers()
	bo := u.c.newBackoff()
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
		if u.c.cfg.Upstream.ForwardCredentials && src.kind != sourcePeer && !presentsToken(presenter) {
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
		if u.c.cfg.Upstream.ForwardCredentials && src.kind != sourcePeer && noteRefused(presenter, err) {
			u.c.log.Warn("upstream refused the token a key's stream presented: presenting another member's next", "key", u.k.key, "node", node.GetId(), "err", err)
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
		u.c.log.Warn("upstream stream failed", "key", u.k.key, "err", err, "retry_in", d.Round(time.Millisecond))
		u.c.metrics.UpstreamReconnects.Inc()
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
			if u.idleFired() {
				return false
			}
		}
	}
	return true
}

// idleFired handles the key's idle timer (idleC): it reports whether the
// key, idle all along, was dropped and the feed ends.
func (u *feed) idleFired() bool {
	u.idle = nil // spent: checkIdle arms a new one if still idle
	return u.c.dropIfIdle(u.k)
}

// ownerReady reports whether the relay's connection to the owner at addr
// is ready.
func (u *feed) ownerReady(addr string) bool { return u.c.pool.Ready(addr) }

// confirmedBySilence counts views confirmed by the source's silence, and
// marks them fresh (as fresh as the owner's, from an owner).
func (u *feed) confirmedBySilence() {
	u.c.metrics.SilentConfirms.Inc()
	u.setStale(u.ownerStale)
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
			if u.idleFired() {
				return false
			}
		}
	}
}

// session runs one stream to the key's source until it fails, ends or
// must be replaced. got reports whether any response arrived. It takes
// the stream's turn (the upstream's pace, a first-answer slot), opens it,
// and runs the session's loop (session.go), giving everything back when
// the loop ends.
func (u *feed) session(ctx context.Context, node *core.Node, presenter member, src source) (got bool, err error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The upstream's pace of new streams (Config.Upstream.StreamRate): taken
	// before a slot, so that no slot waits on it.
	if src.kind != sourcePeer && u.c.upstreamRate != nil && !u.c.upstreamRate.Allow() {
		u.c.metrics.UpstreamWaiting.Inc()
		u.c.metrics.WaitingOpen.Add(1)
		err := u.c.upstreamRate.Wait(ctx)
		u.c.metrics.WaitingOpen.Add(-1)
		u.c.metrics.UpstreamWaiting.Dec()
		if err != nil {
			return false, ctx.Err()
		}
	}
	// A slot of the relay's first answers (Config.Upstream.Syncs), held
	// until the stream answered every type or for syncSlotHold at most.
	// Streams to keys' owners take theirs from a pool of their own: an
	// owner's first answer waits on the owner's upstream stream, which must
	// never wait behind streams to other owners, or relays whose slots all
	// hold streams to each other wait on each other until syncSlotHold.
	slots := u.c.syncs
	if src.kind == sourcePeer {
		slots = u.c.peerSyncs
	}
	release, ok := slots.acquire(ctx)
	if !ok {
		return false, ctx.Err()
	}
	defer release()
	// When the slot goes back, and when silence confirms the views
	// (firstAnswers). A Delta upstream is made to answer every type
	// (deltaSubscribe declares one resource at a version no server has); a
	// SotW upstream may stay silent when nothing changed, and so may an
	// owner whose view is older than what this relay holds.
	first := newFirstAnswers(time.Now(), src.kind == sourcePeer || !u.delta)
	defer first.stop()
	up, err := u.open(sctx, node, presenter, src)
	if err != nil {
		return false, err
	}
	defer func() {
		up.Close()
		if src.kind == sourcePeer {
			// The owner tells the key's splits in its trailer, also when
			// this session ended first for a reason of its own.
			u.readSplits(up.Trailer())
		}
	}()
	u.send = up.Send
	defer u.countStream(src)()
	u.begin(presenter)
	u.k.presentedNode.Store(node)
	u.log("upstream stream open", "node", node.GetId(), "source", src.kind, "owner", src.addr)
	// retry ticks while the key is in fallback (is the owner back?) or a
	// switch of source waits for the new source to be reachable.
	retry := time.NewTicker(peerRetryInterval)
	defer retry.Stop()
	s := &session{u: u, src: src, up: up, node: node, first: first, release: release,
		answered: make(map[string]bool), retryTicker: retry}
	if src.kind == sourceFallback {
		s.retry = retry.C
	}
	if err := u.resubscribe(); err != nil {
		return false, err
	}
	u.renewing = false // the first requests asked for answers
	if s.refresh = u.refreshTimer(presenter); s.refresh != nil {
		defer s.refresh.Stop()
	}
	if s.renew() { // a demand this stream cannot cover either
		return false, errRenew
	}
	err = s.loop(ctx)
	return s.got, err
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
	conn := u.c.upConn
	u.delta = u.c.cfg.Upstream.Protocol == ProtocolDelta
	u.demandCarried = 0
	if src.kind == sourcePeer {
		var err error
		if conn, err = u.c.pool.Conn(src.addr); err != nil {
			return nil, fmt.Errorf("owner %s: %w", src.addr, err)
		}
		sctx = u.c.host.peerContext(sctx, u.k.key)
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
	if u.c.cfg.Upstream.ForwardCredentials && presenter != nil {
		// The member's own token: istiod checks it against the node this
		// stream presents, which is that member's.
		_, cred := presenter.presents()
		sctx = withCredential(sctx, cred)
	}
	return adsclient.Open(sctx, conn, adsclient.Config{Delta: u.delta, Node: node})
}

// countStream counts the session's stream as open, by source, until the
// returned func is called.
func (u *feed) countStream(src source) (uncount func()) {
	if src.kind == sourcePeer {
		u.c.metrics.PeerStreams.Inc()
		u.c.metrics.PeerOpen.Add(1)
		return func() {
			u.c.metrics.PeerStreams.Dec()
			u.c.metrics.PeerOpen.Add(-1)
		}
	}
	u.c.metrics.UpstreamStreams.Inc()
	u.c.metrics.UpstreamOpen.Add(1)
	return func() {
		u.c.metrics.UpstreamStreams.Dec()
		u.c.metrics.UpstreamOpen.Add(-1)
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
	u.sessionAt, u.opened = u.c.clock.Later(sessionStampWait, uint16(randN(u.c.rand, int64(1<<15)))), time.Now()
	for _, ut := range u.types {
		ut.asked, ut.nonce, ut.named, ut.answered, ut.told = false, "", false, false, false // what it was asked is asked again
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
	case src.kind != sourcePeer && d.Before(u.sessionAt) && !u.silentBefore(ledger.Stamp(u.k.answersDemanded.Load())): // as Covers wants
		return 0, false // the current stream was opened after it (and a held route wants no type it may not answer)
	}
	if left := renewAfter - time.Since(u.opened); left > 0 {
		return left, false
	}
	u.log("renewing upstream stream: a client holds a version it cannot cover", "arrived", d.String())
	return 0, true
}

// silentBefore reports whether the current stream was told the version
// the relay holds of a type (SotW) that it has not answered, and whose
// view is no newer than d, a held route's demand (keyState.demandAnswers):
// a server that holds that version may never answer it (go-control-plane's
// snapshot cache answers a version that differs), so the view would never
// come from a stream opened after d on this stream, however long it lives;
// a renewal's stream asks for every type's answer. Only a held route's
// demand, raised past ResourceWaitTimeout, asks this of a stream: a
// client's demand waits for the answers (istiod answers every type on a
// new stream, and may take minutes to).
func (u *feed) silentBefore(d ledger.Stamp) bool {
	if d == 0 {
		return false
	}
	set := u.k.views.Load()
	for typeURL, ut := range u.types {
		if !ut.told || ut.answered || xds.Silent(typeURL) {
			continue
		}
		if ts := set.Types[typeURL]; ts == nil || !d.Before(ts.Order.Session) {
			return true
		}
	}
	return false
}

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
// answered every type yet (Config.Upstream.Syncs): a stream's first answers
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
func (s syncSlots) acquire(ctx context.Context) (release func(), ok bool) {
	if s == nil {
		return func() {}, true
	}
	select {
	case s <- struct{}{}:
		return s.releaser(), true
	case <-ctx.Done():
		return nil, false
	}
}

// tryAcquire takes a slot if one is free now (acquire without waiting).
func (s syncSlots) tryAcquire() (release func(), ok bool) {
	if s == nil {
		return func() {}, true
	}
	select {
	case s <- struct{}{}:
		return s.releaser(), true
	default:
		return nil, false
	}
}

// releaser gives a slot taken back, once however often it is called.
func (s syncSlots) releaser() func() {
	var once sync.Once
	return func() { once.Do(func() { <-s }) }
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
	changed := cur.Stale != stale || (!stale && cur.Restored)
	if changed {
		k.update(func(next *views.Set) {
			next.Stale = stale
			if !stale {
				next.Restored = false // a live source confirmed the views
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
		u.c.persist(u.k)
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
	k.c.ledger.SetSource(string(k.key), src, k.views.Load().Stale)
	k.c.reportSplits(k.key)
}
