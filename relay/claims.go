package relay

import (
	"context"
	"slices"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/claims"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// A SotW client says of each type only the version it holds (version_info,
// a Merkle root). A relay whose key history has that version knows what
// the client holds (stream.resolveClaim); one that lacks it asks the tier
// and the snapshot store (relay/claims), once per key and question
// (claimTable). Until they answer, the type and those after it in push
// order wait, as they do for a type the key's source has not answered yet;
// the answers end the wait, whatever they are. A relay that moves a SotW
// Envoy away hands what it holds over to the store first (handOver).

// newClaimLookup builds what asks the tier and the store about claimed
// versions.
func (r *Relay) newClaimLookup() (*claims.Lookup, error) {
	cfg := claims.Config{
		Store: r.store, Conns: r.pool, AsPeer: r.asPeer, Logger: r.log, MaxMsgSize: r.cfg.MaxMsgSize,
		WaitWarn: r.cfg.XDS.ResourceWaitTimeout, GatherTimeout: r.cfg.Tier.GatherTimeout,
	}
	if r.cfg.Tier.Peers != nil {
		cfg.Peers = r.cfg.Tier.Peers.PeerAddrs
	}
	if hv, ok := r.cfg.Keys.Snapshots.(HeldVersions); ok {
		cfg.Held = hv
	}
	return claims.New(cfg)
}

// askTier looks sub's claimed version up in the tier and the snapshot
// store, and reports whether there is any to ask: other relays, or a store
// that keeps held versions.
func (r *Relay) askTier(s *stream, sub *typeSub) bool {
	if !r.claims.Askable() {
		return false
	}
	q := claimQuestion{typeURL: sub.typeURL, root: sub.claimed, wildcard: sub.wildcard}
	req := &inspectpb.VersionRequest{Key: string(s.key.name()), Type: sub.typeURL, Root: sub.claimed.String(), Wildcard: sub.wildcard}
	if !sub.wildcard {
		q.names = wire.ListDigest(sub.names)
		req.Names = slices.Clone(sub.names) // read by the asking goroutine
	}
	k := s.key
	claims := k.claimLookups()
	claims.mu.Lock()
	defer claims.mu.Unlock()
	if sub.lookup = claims.m[q]; sub.lookup != nil {
		return true
	}
	if len(claims.m) >= maxClaimLookups {
		clear(claims.m)
	}
	if claims.m == nil {
		claims.m = make(map[claimQuestion]*claimLookup)
	}
	l := &claimLookup{done: make(chan struct{})}
	claims.m[q], sub.lookup = l, l
	ran := r.goRun(func(ctx context.Context) {
		l.held, l.ok, l.from = r.claims.Version(ctx, req, q.root)
		if l.ok && l.from == "store" {
			k.sentHeld(l.held) // the tier's other relays may be asked next
		}
		close(l.done)
		k.wakeStreams()
	})
	if !ran {
		close(l.done) // stopping: nothing learnt (ok false)
	}
	return true
}

// heldID names a version handed over: a key's version of a type.
type heldID struct {
	key     aggkey.Key
	typeURL string
	root    ledger.Hash
}

// handOverTimeout bounds what handOver waits for: the stream's answer
// (dumpWait) and the store's writes of one Envoy. After a failure, moves
// do not hand over for handOverPause: a drain while etcd is down moves its
// Envoys at the pace it planned, at the cost of the hand-over.
const (
	handOverTimeout = 5 * time.Second
	dumpWait        = time.Second
	handOverPause   = 10 * time.Second
)

// handOver keeps in the snapshot store (HeldVersions) what the SotW Envoy
// of s holds of each type, before the relay moves it away: it will claim
// those versions of the relay it reconnects to, which may not know them,
// and by then this relay may be gone, or out of the ring its peers ask
// (draining). Even its key's live view is handed over: the relays that
// have it restart too in a rolling restart. What was handed over in the
// last handOverFresh is not again, so the Envoys of a key that hold the
// same version cost one write (and the store writes only what etcd
// lacks: most often the record alone). A failure costs the hand-over,
// not the move.
func (r *Relay) handOver(ctx context.Context, s *stream) {
	hv, ok := r.cfg.Keys.Snapshots.(HeldVersions)
	if !ok || s.delta || s.peerRelay != nil {
		return
	}
	if failed := r.handOverFailed.Load(); failed != 0 && time.Since(time.Unix(0, failed)) < handOverPause {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, handOverTimeout)
	defer cancel()
	q := dumpReq{reply: make(chan dumpReply, 1)}
	wait := time.NewTimer(dumpWait)
	defer wait.Stop()
	select {
	case s.dumps <- q:
	case <-s.ctx.Done():
		return
	case <-ctx.Done():
		return
	case <-wait.C:
		return // the stream is busy sending: it goes without
	}
	reply := <-q.reply
	k := reply.key
	if k == nil {
		return
	}
	for _, dt := range reply.types {
		t, whole := treeOf(dt.Entries)
		id := heldID{k.name(), dt.URL, t.Root()}
		if !whole || t.Len() == 0 || !xds.Cached(dt.URL) || !r.handing(id) {
			continue
		}
		// Every body: the store writes only those it has not written
		// itself. Those of the key's live view were assumed in etcd; but
		// the key's snapshot may not have been flushed yet, and the
		// relay the Envoy moved to found the version without a body
		// (TestSotWClaimKnownAfterItsRelayIsGone, 3 runs in 12).
		bodies := make([]*xds.Resource, 0, t.Len())
		for e := range t.All() {
			bodies = append(bodies, e.Value)
		}
		if err := hv.SaveHeld(ctx, string(k.name()), xds.View{Type: dt.URL, Tree: t}, bodies); err != nil {
			r.handed.Delete(id)
			r.handOverFailed.Store(time.Now().UnixNano())
			r.log.Warn("a SotW Envoy's version not handed over; the relay it moves to may not know it (moves do not hand over for a while)", "key", k.name(), "type", xds.ShortType(dt.URL), "pause", handOverPause, "err", err)
			return
		}
		r.metrics.HandedOver.Inc()
	}
}

// handOverFresh is how long a version handed over is not handed over again
// (the store keeps it for a collection interval, 10 minutes by default).
const handOverFresh = time.Minute

// handing reports whether id is to be handed over now: it was not in the
// last handOverFresh. It notes it as handed over.
func (r *Relay) handing(id heldID) bool {
	now := time.Now()
	if at, ok := r.handed.Load(id); ok && now.Sub(at.(time.Time)) < handOverFresh {
		return false
	}
	r.handed.Store(id, now)
	if r.handedN.Add(1)%1024 == 0 { // now and then, forget the stale ones
		r.handed.Range(func(k, at any) bool {
			if now.Sub(at.(time.Time)) >= handOverFresh {
				r.handed.Delete(k)
			}
			return true
		})
	}
	return true
}

// treeOf builds a tree of entries, and reports whether every entry has its
// value.
func treeOf(entries []ledger.Entry[*xds.Resource]) (ledger.Tree[*xds.Resource], bool) {
	b := ledger.Tree[*xds.Resource]{}.Edit()
	for _, e := range entries {
		if e.Value == nil {
			return ledger.Tree[*xds.Resource]{}, false
		}
		b.Set(e.Name, e.Hash, e.Value)
	}
	return b.Tree(), true
}

// GetVersion answers another relay of the tier what a version of one of
// this relay's keys held (claims.Lookup asks it): every resource's name and hash,
// with the body of those the key's view no longer holds as they were.
func (s inspectServer) GetVersion(ctx context.Context, req *inspectpb.VersionRequest) (*inspectpb.VersionContent, error) {
	if err := s.r.checkPeerCall(ctx, s.port, "inspect"); err != nil {
		return nil, err
	}
	root, err := ledger.ParseHash(req.GetRoot())
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "root: %v", err)
	}
	k := s.r.cache.key(aggkey.Key(req.GetKey()))
	if k == nil {
		return nil, status.Errorf(codes.NotFound, "key %q: %v", req.GetKey(), ErrNotHeld)
	}
	held, ok := k.versionHeld(req.GetType(), req.GetWildcard(), xds.NewNameSet(req.GetNames()), root)
	if !ok {
		return nil, status.Errorf(codes.NotFound, "key %q: version %s of %s not in history", req.GetKey(), root, xds.ShortType(req.GetType()))
	}
	var view ledger.Tree[*xds.Resource]
	if ts := k.published().Types[req.GetType()]; ts != nil {
		view = ts.View
	}
	return claims.Content(s.r.cfg.ID, held, view, req.GetBodies(), s.r.store.Lookup), nil
}
