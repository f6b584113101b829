package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"
	"unique"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/configdump"
	"github.com/meshrelay/meshrelay/relay/passthrough"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// stream is one downstream ADS stream, SotW or Delta. All of its state is
// owned by the stream's handler goroutine; other goroutines only wake it.
type stream struct {
	srv   *server
	id    uint64
	delta bool
	port  port // the listener it came in on
	ctx   context.Context
	peer  string
	log   *slog.Logger

	node *core.Node // from the first request, kept for the stream
	key  joinedKey
	// next is the key the stream moves to after a split of its key
	// (rekey.go), a member of both until next's views cover the
	// stream's subscriptions; splitGen is the relay's splitBook.gen when
	// the stream last looked at where it belongs.
	next     joinedKey
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
	// evict is closed when the stream gives way to another identity's
	// share of the relay's streams (admission.Shares).
	evict chan struct{}
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
	pass          *passthrough.Passthrough
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

func (srv *server) newStream(ctx context.Context, delta bool, p port) *stream {
	s := &stream{
		srv:   srv,
		id:    srv.streamID.Add(1),
		delta: delta,
		port:  p,
		ctx:   ctx,
		wake:  make(chan struct{}, 1),
		evict: make(chan struct{}),
		dumps: make(chan dumpReq),
		subs:  make(map[string]*typeSub),

		opened: time.Now(),

		status: make(map[string]*TypeStatus),
	}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		s.peer = p.Addr.String()
	}
	s.log = srv.log.With("stream", s.id, "protocol", protocolName(delta))
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
		s.key = s.srv.acquireKey(pi.key, s)
		s.tellSplits(pi)
		if pi.demand != 0 {
			s.key.demand(pi.demand, true)
		}
		s.srv.metrics.PeerClients.Inc()
		s.log.Debug("peer stream attached", "peer", s.peer)
		return nil
	}
	if err := s.checkIdentity(node); err != nil {
		return err
	}
	if err := s.srv.cfg.XDS.Authorizer.Authorize(s.ctx, node); err != nil {
		s.log.Warn("stream refused", "node", node.GetId(), "peer", s.peer, "err", err)
		return status.Errorf(codes.PermissionDenied, "node %q: %v", node.GetId(), err)
	}
	// The key is derived only now, from a node its identity may present.
	s.splitGen = s.srv.cache.splits.gen.Load()
	key, base := s.srv.cache.keyOf(node, s.identity)
	s.log = s.log.With("node", node.GetId(), "key", key)
	s.key = s.srv.acquireKey(key, s)
	s.key.leftBySplit(key, base)
	s.led = s.srv.ledgerConnect(node, key, time.Now())
	s.srv.metrics.Envoys.WithLabelValues(protocolName(s.delta)).Inc()
	s.log.Debug("stream attached", "peer", s.peer)
	return nil
}

// close releases everything the stream holds. It runs on the handler
// goroutine as it returns.
func (s *stream) close() {
	s.srv.shares.Leave(s)
	s.stopPassthrough()
	if s.danglingTimer != nil {
		s.danglingTimer.Stop()
	}
	if s.key != nil {
		s.led.Disconnect(time.Now())
		if s.next != nil {
			s.next.leave(s, s.subscriptions())
		}
		s.srv.releaseKey(s)
		if s.peerRelay != nil {
			s.srv.metrics.PeerClients.Dec()
		} else {
			s.srv.metrics.Envoys.WithLabelValues(protocolName(s.delta)).Dec()
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
	if limit := s.srv.cfg.XDS.MaxSubscribedNames; n > limit {
		return status.Errorf(codes.InvalidArgument, "%d names for %s exceed the limit of %d a stream", n, typeURL, limit)
	}
	return nil
}

// newSub starts a subscription from a stream's first request for a type.
func (s *stream) newSub(typeURL string, wildcard, legacy bool, names xds.NameSet) *typeSub {
	names = s.srv.cache.nameSets.Intern(names) // the key's streams (and keys) that ask alike share one set
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
	names = s.srv.cache.nameSets.Intern(names) // the key's streams (and keys) that ask alike share one set
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
	tm := s.srv.metrics.ForType(sub.typeURL)
	if errorDetail != "" {
		s.updateStatus(sub.typeURL, func(st *TypeStatus) {
			st.NACK = &NACK{Version: sent.version, Detail: errorDetail, At: now}
		})
		tm.NACKs.Inc()
		s.log.Warn("NACK", "type", xds.ShortType(sub.typeURL), "version", sent.version, "nonce", sent.nonce, "detail", errorDetail)
		return
	}
	s.updateStatus(sub.typeURL, func(st *TypeStatus) {
		st.AckedVersion, st.AckedAt, st.NACK = sent.version, now, nil
	})
	d := now.Sub(sent.at)
	tm.PushACK.Observe(d.Seconds())
	s.srv.pushACK.Observe(d)
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
	if ts := s.key.published().Types[sub.typeURL]; ts != nil {
		view = ts.View
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

// joinedKey is what a stream knows of the aggregation key it is joined to
// (keyState, in the key's cache): the seam between the downstream server
// and the cache. A stream reads the key's published views and tells the
// key what its client subscribes to, holds and demands; it takes none of
// the key's locks and reads none of its fields.
type joinedKey interface {
	name() aggkey.Key
	// published returns the key's latest views (never nil).
	published() *views.Set
	// subscribe moves the stream's subscription to a type from before to
	// after; leave takes the stream (with its subscriptions) out.
	subscribe(typeURL string, wildcardBefore, wildcardAfter bool, before, after xds.NameSet)
	leave(m member, subs iter.Seq2[string, subscription])
	// demand asks the key's source for a stream that covers what a client
	// holds, stamped at.
	demand(at ledger.Stamp, fromPeer bool)
	demandAnswers(at ledger.Stamp)
	// leftBySplit tells the key, which the stream joins, that it is the
	// split key of base (or base, merged back); splitBase is the key a
	// split key split from; abandon says the stream left a split key for
	// good.
	leftBySplit(key, base aggkey.Key)
	splitBase() aggkey.Key
	abandon()
	// sentHeld notes a version a SotW client was sent that is no version
	// of the views; versionHeld finds one (or a version of the views) by
	// root; lastContent returns the last content the key had of names.
	sentHeld(t ledger.Tree[*xds.Resource])
	versionHeld(typeURL string, wildcard bool, names xds.NameSet, root ledger.Hash) (ledger.Tree[*xds.Resource], bool)
	lastContent(typeURL string, names []string) []*xds.Resource
	// claimLookups are the key's lookups of claimed versions in the tier
	// (claims.go); wakeStreams wakes its streams once one is answered.
	claimLookups() *claimTable
	wakeStreams()
}

// acquireKey returns the key's state, creating it (and its feed) if
// needed, with s joined as a member and attached.
func (srv *server) acquireKey(key aggkey.Key, s *stream) *keyState {
	srv.mu.Lock()
	defer srv.mu.Unlock()
	k := srv.cache.join(key, s)
	srv.attached[s] = k
	return k
}

// attach records s as attached to k, which it joined (keyCache.join).
func (srv *server) attach(s *stream, k joinedKey) {
	srv.mu.Lock()
	defer srv.mu.Unlock()
	srv.attached[s] = k
}

// releaseKey takes s, which acquireKey joined to s.key, out of its key.
func (srv *server) releaseKey(s *stream) {
	srv.mu.Lock()
	delete(srv.attached, s)
	srv.mu.Unlock()
	s.key.leave(s, s.subscriptions())
}

// ledgerConnect starts the ledger's record of an Envoy's stream, with
// what istioctl shows of its node: the namespace (proxy-status -n), the
// cluster and the proxy version, from Istio's node metadata.
func (srv *server) ledgerConnect(node *core.Node, key aggkey.Key, at time.Time) *ledger.Envoy {
	e := srv.ledger.Connect(node.GetId(), string(key), at)
	f := node.GetMetadata().GetFields()
	field := func(name string) string { return unique.Make(f[name].GetStringValue()).Value() } // one copy for a key's Envoys
	e.SetMeta(ledger.NodeMeta{Namespace: field("NAMESPACE"), Cluster: field("CLUSTER_ID"), Version: field("ISTIO_VERSION")})
	return e
}

// dumpReq asks a stream's goroutine, which owns its state, what it sent.
type dumpReq struct {
	types []string // empty: all
	reply chan dumpReply
}

// dumpReply is a stream's answer to a dumpReq: its key and what it sent.
type dumpReply struct {
	key   joinedKey
	types []configdump.Type
}

// sent lists what the stream sent its client, by type (run by the stream's
// goroutine). Content the client declared on connecting and this relay
// never sent it is included if the relay holds it.
func (s *stream) sent(types []string) []configdump.Type {
	var out []configdump.Type
	for _, typeURL := range xds.PushOrder {
		sub := s.subs[typeURL]
		if sub == nil || len(types) > 0 && !slices.Contains(types, typeURL) {
			continue
		}
		dt := configdump.Type{URL: typeURL, Version: sub.known.Root().String()}
		for e := range sub.known.All() {
			if e.Value == nil {
				e.Value = s.srv.store.Lookup(e.Hash)
			}
			dt.Entries = append(dt.Entries, e)
		}
		out = append(out, dt)
	}
	return out
}

// recvError turns the end of a client's stream into the handler's result:
// a client going away is not an error.
func recvError(err error) error {
	if status.Code(err) == codes.Canceled || errors.Is(err, context.Canceled) {
		return nil
	}
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

// debugAnswer is what a stream last answered for a debug type URL.
type debugAnswer struct {
	nonce string
	names []string
}

// debugAnswered reports whether a debug request is the client's ACK or
// NACK of the stream's last answer of its type, which is not answered
// again: it names that answer's nonce, and the same resource names or
// an error (Delta: no new names, or an error). Anything else is a
// question, answered as istiod answers every debug request. Istio's ADS
// client (pkg/adsc, which istioctl uses) puts a nonce of its own (a
// timestamp) on every request, its first included, and never ACKs a debug
// answer; an xDS client that does ACK is not answered in a loop.
func (s *stream) debugAnswered(typeURL, responseNonce string, names []string, nack, delta bool) bool {
	last, ok := s.debugSent[typeURL]
	if !ok || responseNonce == "" || responseNonce != last.nonce {
		return false
	}
	return nack || slices.Equal(names, last.names) || delta && len(names) == 0
}

// debugNonce numbers a debug answer and remembers it (debugAnswered).
func (s *stream) debugNonce(typeURL string, names []string) string {
	s.nonce++
	nonce := strconv.FormatUint(s.nonce, 10)
	if s.debugSent == nil {
		s.debugSent = make(map[string]debugAnswer)
	}
	s.debugSent[typeURL] = debugAnswer{nonce: nonce, names: slices.Clone(names)}
	return nonce
}
