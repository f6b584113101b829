package relay

import (
	"context"
	"fmt"
	"iter"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// stream is one downstream ADS stream, SotW or Delta. All of its state is
// owned by the stream's handler goroutine; other goroutines only wake it.
type stream struct {
	r     *Relay
	id    uint64
	delta bool
	port  port // the listener it came in on
	ctx   context.Context
	peer  string
	log   *slog.Logger

	node *core.Node // from the first request, kept for the stream
	key  *keyState
	// next is the key the stream moves to after a split of its key
	// (rekey.go), a member of both until next's views cover the
	// stream's subscriptions; splitGen is the relay's splitBook.gen when
	// the stream last looked at where it belongs.
	next     *keyState
	splitGen uint64
	// splitsTold is the key's splits (aggkey.EncodeSplits) told to the
	// relay on the other end of a peer stream.
	splitsTold string
	// peerRelay is set on a stream from another relay of the tier, which
	// subscribes to a key this relay owns.
	peerRelay *peerIdentity
	// identity is the workload a stream on the TLS port proved it is (nil
	// elsewhere): the node it presents must be of it.
	identity *auth.Identity
	// cred is the token the key's upstream stream may present for this
	// member (forward mode); nil if none.
	cred *credential
	wake chan struct{}
	// dumps asks the stream what it sent (Relay.ConfigDump).
	dumps chan dumpReq
	// led is the stream's entry in the relay's ledger (nil for a peer
	// relay's stream).
	led *ledger.Envoy

	nonce uint64
	subs  map[string]*typeSub
	// debugSent is, per debug type URL, the last answer sent on the
	// stream (debugxds.go): a request naming its nonce is its ACK.
	debugSent map[string]debugAnswer
	// opened is when the stream started.
	opened time.Time
	// answered is set once the client answered (ACK or NACK) a response
	// on the stream: every request it sent when the stream opened has
	// come (awaitingDeclarations). probe is the type answered as it is,
	// to get such an answer, when nothing else was sent (undeclared);
	// graceArmed, once a wake-up is set for the end of declareGrace.
	answered   bool
	probe      string
	graceArmed bool
	// dangling holds, by "type|name", the listeners and route
	// configurations held back for a cluster the client cannot use yet
	// (deferDangling); danglingTimer wakes the stream when the earliest
	// of their waits ends (danglingDue), one timer for all.
	dangling      map[string]*hold
	plans         planScratch // sync's
	danglingTimer *time.Timer
	danglingDue   time.Time
	pass          *passthrough
	// dirty is set when a subscription changed or the key's views did:
	// the stream must sync.
	dirty bool

	statusMu sync.Mutex
	status   map[string]*TypeStatus // by type URL; read by Relay.Clients

	// send writes one response of a cached type, sendRaw a passthrough
	// answer; both are the protocol's own.
	send    func(*wire.Response) error
	sendRaw func(proto.Message) error
}

// typeSub is a stream's subscription to one cached type and what the client
// holds of it.
type typeSub struct {
	typeURL  string
	wildcard bool
	// legacy is set while the subscription is wildcard only because the
	// first request named nothing.
	legacy bool
	names  xds.NameSet
	// listID identifies the latest SotW request's name list.
	listID wire.ListID

	// known is what the client holds, as far as the relay knows: what it
	// was sent (ACKed or not: a NACKed version is not sent again until the
	// content changes) or declared it had. For a non-wildcard subscription
	// it only ever holds subscribed names.
	known ledger.Tree[*xds.Resource]

	// awaitFirst is set until the client got its first answer: it must get
	// one once the type is ready, even an empty one.
	awaitFirst bool
	// orders are the Orders of what the client declared it holds (its Delta
	// initial_resource_versions, its SotW version_info) until the key's
	// view covers them: until then the client keeps what it holds (see
	// reconnected).
	orders orderSet
	// declared is set while what the client declared it holds is not
	// settled by reconnected: a view replaces it only if it covers orders
	// (a view of unknown age, restored from a snapshot, covers nothing).
	declared bool
	// sentOrder and sentStale are, on a peer relay's stream, the Order of
	// the latest response and whether it was marked stale: a new Order of
	// the same content, or the key's source going stale or live, is news to
	// the peer (see orderNews).
	sentOrder ledger.Order
	sentStale bool
	// claimed is the SotW version_info of the first request, checked once
	// the type is ready: if it is the current content the client is current.
	// claimTried is set once the key's history was asked for it
	// (resolveClaim).
	claimed    ledger.Hash
	claimTried bool
	// claimKnown is set once known is what the claimed version holds.
	claimKnown bool
	// unsettled is set while the client holds a version nobody knew (a
	// SotW claim no relay or store could resolve) that reconnected let
	// the view replace, until the relay has sent every difference: what
	// it still holds of the old version may refer to anything (refers),
	// even once the claim is cleared, since a route is sent only after
	// the clusters it names (deferDangling).
	unsettled bool
	// lookup is the tier's lookup of the claimed version, while it runs
	// (claimPending).
	lookup *claimLookup

	// nonce is the latest response's nonce (SotW: older ones are stale).
	nonce string
	// inflight lists Delta responses not yet answered, oldest first.
	inflight []sentResponse
	// sent is the latest response (SotW: the one an ACK refers to).
	sent sentResponse
	// rejected holds the names of responses the client NACKed that it has
	// not been sent again since (the relay does not send rejected content
	// again until it changes): until it has, it is not on the view.
	rejected map[string]struct{}
}

type sentResponse struct {
	nonce, version string
	at             time.Time
	// from and to are what the client held before and after it: what the
	// response changed, which is what a NACK of it rejects.
	from, to ledger.Tree[*xds.Resource]
}

// maxInflight bounds the Delta responses remembered for ACK matching; a
// client that never answers costs no more than this.
const maxInflight = 32

// TypeStatus is what the relay knows of one stream's state for one type.
type TypeStatus struct {
	SentVersion  string
	SentAt       time.Time
	AckedVersion string
	AckedAt      time.Time
	// NACK is the last rejection, cleared by a later ACK.
	NACK *NACK
}

// NACK is a client's rejection of a version.
type NACK struct {
	Version string
	Detail  string
	At      time.Time
}

func (r *Relay) newStream(ctx context.Context, delta bool, p port) *stream {
	s := &stream{
		r:     r,
		id:    r.streamID.Add(1),
		delta: delta,
		port:  p,
		ctx:   ctx,
		wake:  make(chan struct{}, 1),
		dumps: make(chan dumpReq),
		subs:  make(map[string]*typeSub),

		opened: time.Now(),

		status: make(map[string]*TypeStatus),
	}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		s.peer = p.Addr.String()
	}
	s.log = r.log.With("stream", s.id, "protocol", protocolName(delta))
	return s
}

func protocolName(delta bool) string {
	if delta {
		return "delta"
	}
	return "sotw"
}

// attach binds the stream to its node and key on the first request.
func (s *stream) attach(node *core.Node) error {
	if node.GetId() == "" {
		return status.Error(codes.InvalidArgument, "the first request of a stream must carry a node with an id")
	}
	s.node = node
	if pi := s.peerRelay; pi != nil {
		// Another relay, proven by its peer secret, subscribing for its
		// Envoys of a key: it authorized them itself, and it names the key
		// so that both relays agree on it whatever the profile.
		s.log = s.log.With("node", node.GetId(), "key", pi.key, "peer_relay", pi.id)
		s.key = s.r.acquireKey(pi.key, s)
		s.tellSplits(pi)
		if pi.demand != 0 {
			s.key.demand(pi.demand, true)
		}
		s.r.metrics.peerClients.Inc()
		s.log.Debug("peer stream attached", "peer", s.peer)
		return nil
	}
	if err := s.checkIdentity(node); err != nil {
		return err
	}
	if err := s.r.cfg.Authorizer.Authorize(s.ctx, node); err != nil {
		s.log.Warn("stream refused", "node", node.GetId(), "peer", s.peer, "err", err)
		return status.Errorf(codes.PermissionDenied, "node %q: %v", node.GetId(), err)
	}
	// The key is derived only now, from a node its identity may present.
	s.splitGen = s.r.splits.gen.Load()
	key, base := s.r.keyOf(node, s.identity)
	s.log = s.log.With("node", node.GetId(), "key", key)
	s.key = s.r.acquireKey(key, s)
	s.key.leftBySplit(key, base)
	s.led = s.r.ledgerConnect(node, key, time.Now())
	s.r.metrics.envoys.WithLabelValues(protocolName(s.delta)).Inc()
	s.log.Debug("stream attached", "peer", s.peer)
	return nil
}

// close releases everything the stream holds. It runs on the handler
// goroutine as it returns.
func (s *stream) close() {
	if s.pass != nil {
		s.pass.stop()
	}
	if s.danglingTimer != nil {
		s.danglingTimer.Stop()
	}
	if s.key != nil {
		s.led.Disconnect(time.Now())
		if s.next != nil {
			s.next.leave(s, s.subscriptions())
		}
		s.r.releaseKey(s)
		if s.peerRelay != nil {
			s.r.metrics.peerClients.Dec()
		} else {
			s.r.metrics.envoys.WithLabelValues(protocolName(s.delta)).Dec()
		}
		s.log.Debug("stream closed")
	}
}

// presents, peerRelayID and viewsChanged make a stream a member of its key.

func (s *stream) presents() (*core.Node, *credential) { return s.node, s.cred }

func (s *stream) peerRelayID() string {
	if s.peerRelay == nil {
		return ""
	}
	return s.peerRelay.id
}

func (s *stream) viewsChanged() { wake(s.wake) }

// subscriptions yields what the stream subscribes to, by type URL.
func (s *stream) subscriptions() iter.Seq2[string, subscription] {
	return func(yield func(string, subscription) bool) {
		for typeURL, sub := range s.subs {
			if !yield(typeURL, subscription{wildcard: sub.wildcard, names: sub.names}) {
				return
			}
		}
	}
}

// updateStatus changes the published status of one type.
func (s *stream) updateStatus(typeURL string, fn func(*TypeStatus)) {
	s.statusMu.Lock()
	defer s.statusMu.Unlock()
	st := s.status[typeURL]
	if st == nil {
		st = new(TypeStatus)
		s.status[typeURL] = st
	}
	fn(st)
}

// settled reports whether the client answered (ACK or NACK) the latest
// response of every type it was sent.
func (s *stream) settled() bool {
	s.statusMu.Lock()
	defer s.statusMu.Unlock()
	for _, st := range s.status {
		if st.SentVersion != st.AckedVersion && (st.NACK == nil || st.NACK.Version != st.SentVersion) {
			return false
		}
	}
	return len(s.status) > 0
}

func (s *stream) nextNonce() string {
	s.nonce++
	return strconv.FormatUint(s.nonce, 10)
}

// checkNames enforces the per-type subscription limit on untrusted input.
func (s *stream) checkNames(typeURL string, n int) error {
	if limit := s.r.cfg.MaxSubscribedNames; n > limit {
		return status.Errorf(codes.InvalidArgument, "%d names for %s exceed the limit of %d a stream", n, typeURL, limit)
	}
	return nil
}

// newSub starts a subscription from a stream's first request for a type.
func (s *stream) newSub(typeURL string, wildcard, legacy bool, names xds.NameSet) *typeSub {
	names = s.r.nameSets.Intern(names) // the key's streams (and keys) that ask alike share one set
	sub := &typeSub{typeURL: typeURL, wildcard: wildcard, legacy: legacy, names: names, awaitFirst: true}
	s.subs[typeURL] = sub
	s.dirty = true
	s.key.subscribe(typeURL, false, wildcard, nil, names)
	if s.next != nil {
		s.next.subscribe(typeURL, false, wildcard, nil, names)
	}
	s.led.Subscribe(typeURL)
	return sub
}

// resubscribe applies a change of subscription to sub and to the key.
// Names no longer subscribed are forgotten, so that subscribing again sends
// them again. resend lists names the client holds that must be sent again
// (in Delta, every name subscribed again): they stay held, at unknown
// content, so that if the key no longer has them the client still hears of
// the removal.
func (s *stream) resubscribe(sub *typeSub, wildcard bool, names xds.NameSet, resend []string) {
	names = s.r.nameSets.Intern(names) // the key's streams (and keys) that ask alike share one set
	added, removed := sub.names.Diff(names)
	if wildcard == sub.wildcard && len(added) == 0 && len(removed) == 0 && len(resend) == 0 {
		return
	}
	kb := sub.known.Edit()
	if !wildcard {
		// Under a wildcard an unsubscribed name is still subscribed.
		for _, n := range removed {
			kb.Delete(n)
		}
	}
	for _, n := range resend {
		if _, held := kb.Get(n); held {
			kb.Set(n, unknownContent, nil)
		}
	}
	if sub.wildcard && !wildcard {
		for e := range sub.known.All() {
			if !names.Has(e.Name) {
				kb.Delete(e.Name)
			}
		}
	}
	sub.known = kb.Tree()
	s.dirty = true
	s.key.subscribe(sub.typeURL, sub.wildcard, wildcard, sub.names, names)
	if s.next != nil {
		s.next.subscribe(sub.typeURL, sub.wildcard, wildcard, sub.names, names)
	}
	sub.wildcard, sub.names = wildcard, names
	if !wildcard {
		sub.legacy = false
	}
}

// ack records the client's answer to the response with the given nonce and
// version; latest tells whether that is the latest response of its type.
func (s *stream) ack(sub *typeSub, sent sentResponse, errorDetail string, latest bool) {
	now := time.Now()
	if !s.answered {
		s.answered = true
		s.dirty = true // removals that waited for declarations may go
	}
	rejecting := s.noteRejected(sub, sent, errorDetail != "")
	s.led.Answered(sub.typeURL, ledger.Answer{Version: sent.version, Detail: errorDetail, Latest: latest, Rejecting: rejecting, At: now})
	tm := s.r.metrics.forType(sub.typeURL)
	if errorDetail != "" {
		s.updateStatus(sub.typeURL, func(st *TypeStatus) {
			st.NACK = &NACK{Version: sent.version, Detail: errorDetail, At: now}
		})
		tm.nacks.Inc()
		s.log.Warn("NACK", "type", xds.ShortType(sub.typeURL), "version", sent.version, "nonce", sent.nonce, "detail", errorDetail)
		return
	}
	s.updateStatus(sub.typeURL, func(st *TypeStatus) {
		st.AckedVersion, st.AckedAt, st.NACK = sent.version, now, nil
	})
	d := now.Sub(sent.at)
	tm.pushACK.Observe(d.Seconds())
	s.r.pushACK.observe(d)
}

// noteRejected keeps sub.rejected up to date with an answer to sent, and
// reports whether the client still lacks content it rejected.
func (s *stream) noteRejected(sub *typeSub, sent sentResponse, nack bool) bool {
	if s.led == nil {
		return false // not tracked
	}
	if nack {
		if sub.rejected == nil {
			sub.rejected = make(map[string]struct{})
		}
		ledger.Diff(sent.from, sent.to, func(c ledger.Change[*xds.Resource]) bool {
			sub.rejected[c.Name] = struct{}{}
			return true
		})
		return true
	}
	if len(sub.rejected) == 0 {
		return false
	}
	if !s.delta && xds.FullStateSotW(sub.typeURL) {
		clear(sub.rejected) // every response carries everything
		return false
	}
	var view ledger.Tree[*xds.Resource]
	if ts := s.key.views.Load().types[sub.typeURL]; ts != nil {
		view = ts.view
	}
	for n := range sub.rejected {
		f, had := sent.from.Get(n)
		t, has := sent.to.Get(n)
		resent := had != has || (has && f.Hash != t.Hash)
		if _, inView := view.Get(n); resent || !inView {
			delete(sub.rejected, n)
		}
	}
	return len(sub.rejected) > 0
}

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
	ts  *typeView
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
	snap := s.key.views.Load()
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
				s.led.Synced(p.sub.typeURL, p.ts.view.Root(), now)
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
func (s *stream) planTypes(snap *keyViews, now time.Time) (plans, synced []*plan) {
	s.plans.reset()
	plans, synced = s.plans.planned, s.plans.equal
	wait := s.r.cfg.ResourceWaitTimeout
	for _, typeURL := range xds.PushOrder {
		sub := s.subs[typeURL]
		ts := snap.types[typeURL]
		if sub == nil {
			continue
		}
		if ts == nil || !ts.ready || (sub.wildcard && !ts.full) {
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
					plans = append(plans, s.plans.add(plan{sub: sub, ts: ts, stale: snap.stale, upd: upd, want: len(upd) + 1}))
				}
				continue
			}
		}
		upd, gone, whole := sub.changes(ts.view)
		want := len(upd) + len(gone)
		if want == 0 {
			sub.share(ts.view)
			sub.unsettled = false // nothing the relay could send replaces it
		}
		if s.peerRelay == nil {
			// An Envoy is never told that a name the source was asked for
			// and has not answered does not exist. Another relay is told
			// what the view holds, no more: it marks such a name pending
			// itself (feed.apply), and its view stays the owner's.
			gone = slices.DeleteFunc(gone, func(n string) bool { return ts.isPending(n, now, wait) })
		}
		if typeURL == xds.TypeCluster {
			s.forceEndpoints(sub, upd)
		}
		p := s.plans.add(plan{sub: sub, ts: ts, stale: snap.stale, upd: upd, gone: gone, want: want, whole: whole})
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
		(p.ts.order != sub.sentOrder || p.stale != sub.sentStale)
}

// forceEndpoints makes the stream send again the endpoints of every cluster
// that changed: Envoy warms an updated cluster only when its
// ClusterLoadAssignment arrives, even if the endpoints did not change.
func (s *stream) forceEndpoints(cds *typeSub, upd []*xds.Resource) {
	eds := s.subs[xds.TypeEndpoint]
	if eds == nil {
		return
	}
	var kb *ledger.Builder[*xds.Resource]
	for _, r := range upd {
		if _, had := cds.known.Get(r.Name); !had {
			continue
		}
		for _, e := range r.Refs(xds.RefEndpoints) {
			if _, ok := eds.known.Get(e); !ok {
				continue
			}
			if kb == nil {
				kb = eds.known.Edit()
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
func (s *stream) clusterUsable(cds *typeSub, c string) bool {
	e, ok := cds.known.Get(c)
	if !ok {
		return false
	}
	if s.peerRelay != nil {
		return true
	}
	held := e.Value
	if held == nil {
		// Declared at content the relay had not seen then: a client
		// declares a cluster it holds, warm or not, so its endpoints are
		// checked all the same, by the content if the relay has it now,
		// else by the key's cluster of that name (its endpoints' name
		// rarely changes). A cluster nobody here knows is taken as it
		// was: a route to it is dangling whatever the relay does.
		if held = s.r.store.Lookup(e.Hash); held == nil && s.key != nil {
			if ts := s.key.views.Load().types[xds.TypeCluster]; ts != nil {
				v, _ := ts.view.Get(c)
				held = v.Value
			}
		}
		if held == nil {
			return true
		}
	}
	eds := s.subs[xds.TypeEndpoint]
	for _, n := range held.Refs(xds.RefEndpoints) {
		if eds == nil {
			return false
		}
		if _, ok := eds.known.Get(n); !ok {
			return false
		}
	}
	return true
}

// hold is a listener or route configuration held back by deferDangling.
type hold struct {
	since time.Time
	// at is the relay's clock when the hold began: after the resource
	// came. A view of the key's clusters from an upstream stream opened
	// later is the source's word on what it serves (absentProven).
	at   ledger.Stamp
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
// clusters came on an upstream stream opened after the resource did
// (absentProven). A source may send types out of order, and the clusters
// may be slow to come (a large CDS response on a slow link: loadtest
// chaos seed 31 of issue 28's 50), so a view of the same stream proves
// nothing. Past ResourceWaitTimeout the relay says so
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
	wait := s.r.cfg.ResourceWaitTimeout
	var keyCDS *typeView
	if s.key != nil {
		keyCDS = s.key.views.Load().types[xds.TypeCluster]
	}
	kept := p.upd[:0]
	for _, r := range p.upd {
		missing, coming := false, false
		for _, c := range r.Refs(xds.RefClusters) {
			if s.clusterUsable(cds, c) {
				continue
			}
			missing = true
			if keyCDS != nil {
				if _, ok := keyCDS.view.Get(c); ok || keyCDS.isPending(c, now, wait) {
					coming = true
					break
				}
			}
		}
		if !missing && len(s.dangling) == 0 {
			kept = append(kept, r) // the common case: no key built, nothing to forget
			continue
		}
		key := p.sub.typeURL + "|" + r.Name
		if missing {
			h := s.dangling[key]
			if h == nil {
				if s.dangling == nil {
					s.dangling = make(map[string]*hold)
				}
				h = &hold{since: now, at: s.r.clock.Now()}
				s.dangling[key] = h
			}
			if coming || !absentProven(keyCDS, p.ts, h.at) {
				if now.Sub(h.since) < wait {
					s.wakeAt(h.since.Add(wait))
					continue
				}
				if !h.told {
					h.told = true
					s.r.metrics.holds.WithLabelValues(xds.ShortType(p.sub.typeURL), "held").Inc()
					s.log.Warn("a resource is held back past the wait: a cluster it uses is not warm at the client yet",
						"type", xds.ShortType(p.sub.typeURL), "name", r.Name, "waited", now.Sub(h.since).Round(time.Millisecond),
						"cluster_in_view", coming)
				}
				if !coming {
					s.key.demand(h.at, false)
				}
				continue
			}
			s.r.metrics.holds.WithLabelValues(xds.ShortType(p.sub.typeURL), "sent").Inc()
		}
		delete(s.dangling, key)
		kept = append(kept, r)
	}
	p.upd = kept
}

// absentProven reports whether the key's clusters, cds, are the source's
// word on what it serves as of after at, and the resource that names them,
// of view ts, its word as of then too: the clusters came on an upstream
// stream opened later (its first answer is the source's state then; a
// view made of parts has the earliest of their streams), not only later on
// a stream that may still carry what the source had sent before; and the
// resource on that stream or a later one, not from a stream that the
// source has since replaced (each new stream answers every type: it comes).
// A frozen relay that resumed sent a route of its old stream, naming a
// cluster its new stream's clusters had dropped (the simulation's seed 54).
func absentProven(cds, ts *typeView, at ledger.Stamp) bool {
	return cds != nil && at.Before(cds.order.Session) &&
		(ts.order.Session == cds.order.Session || cds.order.Session.Before(ts.order.Session))
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
func (s *stream) reconnected(sub *typeSub, ts *typeView) bool {
	t := sub.target(ts.view)
	held := sub.known.Root()
	if !sub.claimed.IsZero() {
		held = sub.claimed
	}
	current := t.Root() == held
	if !current && !sub.coveredBy(ts) {
		for _, o := range sub.orders {
			if !ts.order.Covers(o) && !ts.order.SameStream(o) {
				s.key.demand(o.At, s.peerRelay != nil)
			}
		}
		return false
	}
	if current && !sub.claimed.IsZero() {
		// A SotW client that reported what the view holds is current:
		// nothing to send.
		version := wire.Version(sub.claimed, ts.order)
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
func (s *stream) keepAskedClusters(sub *typeSub, ts *typeView) {
	eds := s.subs[xds.TypeEndpoint]
	if s.delta || sub.typeURL != xds.TypeCluster || eds == nil || s.key == nil {
		return
	}
	var gone []string
	for _, n := range eds.names {
		if _, ok := ts.view.Get(n); !ok {
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
func (s *stream) baseKey() *keyState {
	key, base := s.r.keyOf(s.node, s.identity)
	if key == base || s.key == nil || s.key.key != key {
		return nil
	}
	s.r.mu.Lock()
	defer s.r.mu.Unlock()
	return s.r.keys[base]
}

// awaitingEndpoints reports whether a SotW client's clusters, claimed at a
// version nobody knew, wait for its request for endpoints, which tells
// what it holds (keepAskedClusters): Envoy sends it with the others when
// the stream opens, so the wait ends once it came, once the client
// answered anything (every first request came), or declareGrace after the
// stream opened (the stream is woken then).
func (s *stream) awaitingEndpoints(sub *typeSub, ts *typeView) bool {
	if s.delta || sub.typeURL != xds.TypeCluster || sub.claimed.IsZero() || sub.claimKnown ||
		s.subs[xds.TypeEndpoint] != nil || s.answered || sub.target(ts.view).Root() == sub.claimed {
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
func (sub *typeSub) coveredBy(ts *typeView) bool {
	return !ts.order.IsZero() && sub.orders.coveredBy(ts.order)
}

// resolveClaim turns a SotW client's claimed version into what it holds,
// once, if the key's history has that version: from then on the relay
// knows each resource the client holds, as it does a Delta client's, and
// holds back the removal of what they still refer to (a full-state CDS
// response that left out a cluster the client's routes use would remove
// it). A claim of the view's content needs nothing; one the history lacks
// is asked of the tier (askTier, claims.go). A claim nobody knows stays a
// root: what the client holds of the type may refer to anything.
func (s *stream) resolveClaim(sub *typeSub, ts *typeView) {
	if sub.claimed.IsZero() || sub.claimTried {
		return
	}
	sub.claimTried = true
	if sub.target(ts.view).Root() == sub.claimed {
		return // current (reconnected)
	}
	if t, ok := s.heldVersion(sub); ok {
		sub.known, sub.claimKnown = t, true
		s.r.metrics.claims.WithLabelValues("history").Inc()
		return
	}
	if !s.askTier(sub) {
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
		r := s.r.store.Lookup(e.Hash)
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
// newer, before).
func (s *stream) lacking(sub *typeSub, ts *typeView) []*xds.Resource {
	if !s.delta || sub.wildcard || ts.order.IsZero() {
		return nil
	}
	view := ts.view
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
	snap := s.key.views.Load()
	ts := snap.types[typeURL]
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
	if _, ok := s.r.refIndex.Names(sub.known, kind)[name]; ok {
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
			if got := apply().Root(); got != p.ts.view.Root() {
				panic(fmt.Sprintf("relay: a whole plan of %s leaves the client at %s, not the view's %s", sub.typeURL, got, p.ts.view.Root()))
			}
		}
		sub.known = p.ts.view
		sub.unsettled = false
	} else {
		sub.known = apply()
		sub.share(p.ts.view)
	}
	first := sub.awaitFirst
	sub.awaitFirst = false
	if sub.typeURL == xds.TypeCluster && len(removed) > 0 {
		s.dropEndpointsOf(fromTree, removed)
	}

	out := &wire.Response{TypeURL: sub.typeURL, Updated: upd, Removed: removed, From: from, To: sub.known.Root(), Order: p.ts.order}
	if s.delta && s.peerRelay == nil && len(upd) == 0 && len(removed) > 0 {
		if c := s.carrier(sub.known, p.ts.view); c != nil {
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
		out.View = p.ts.view.Root()
		out.Version = s.r.versions.Of(out.View, out.Order)
		if s.peerRelay != nil && p.stale {
			out.Version = wire.MarkStale(out.Version)
		}
	case xds.FullStateSotW(sub.typeURL):
		out.From = ledger.Hash{}
		out.Version = s.r.versions.Of(sub.known.Root(), out.Order)
		out.Full, out.Held = true, sub.known
		if sub.known.Root() != p.ts.view.Root() {
			s.key.sentHeld(sub.known) // it may claim it elsewhere
		}
	default:
		// SotW cannot say "removed" for these types: a removal only
		// updates what the relay knows the client holds.
		if len(upd) == 0 && !first {
			return nil
		}
		out.Version = s.r.versions.Of(sub.known.Root(), out.Order)
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
		still = s.r.refIndex.Names(cds.known, xds.RefEndpoints)
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
	return s.r.store.Lookup(e.Hash)
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

// nackDetail renders a NACK's error_detail; "" means the request is an ACK.
func nackDetail(st *rpcstatus.Status) string {
	if st == nil {
		return ""
	}
	if st.GetMessage() == "" {
		return fmt.Sprintf("rejected with code %d", st.GetCode())
	}
	return st.GetMessage()
}
