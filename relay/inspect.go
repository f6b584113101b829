package relay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/configdump"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/tierledger"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// What one relay holds of a key or a node, for the tier's admin API: any
// relay answers by asking every relay of the tier (meshrelay.inspect.v1 on
// the xDS port, with the relay-to-relay proof, as the ledger exchange).

// ErrNotHeld is returned for a key the relay holds no state of, or a node
// not connected to it.
var ErrNotHeld = errors.New("relay: not held here")

// defaultMaxNames bounds the subscribed names KeyDetail lists per type.
const defaultMaxNames = 100

// KeyDetail describes the relay's state of key, listing at most maxNames
// subscribed names per type (0: 100).
func (r *Relay) KeyDetail(key string, maxNames int) (*inspectpb.KeyDetail, error) {
	if maxNames <= 0 {
		maxNames = defaultMaxNames
	}
	k := r.cache.key(aggkey.Key(key))
	if k == nil {
		return nil, fmt.Errorf("key %q: %w", key, ErrNotHeld)
	}
	snap := k.views.Load()
	out := &inspectpb.KeyDetail{Relay: r.cfg.ID, Key: key, Source: sourceKind(k.source.Load()).String(),
		Stale: snap.Stale, Restored: snap.Restored}
	k.mu.Lock()
	for _, m := range k.members {
		if id := m.peerRelayID(); id != "" {
			out.Peers = append(out.Peers, id)
		} else {
			out.Envoys++
		}
	}
	wants := make(map[string]subscription, len(k.want))
	for t, w := range k.want {
		wants[t] = subscription{wildcard: w.wildcard > 0, names: w.names()}
	}
	k.mu.Unlock()
	slices.Sort(out.Peers)
	out.Peers = slices.Compact(out.Peers)
	for _, typeURL := range typesOf(snap, wants) {
		td := &inspectpb.TypeDetail{Type: typeURL}
		if ts := snap.Types[typeURL]; ts != nil {
			td.Resources, td.Version, td.Ready, td.Pending = int64(ts.View.Len()), ts.View.Root().String(), ts.Ready, int64(len(ts.Pending))
			for e := range ts.View.All() {
				td.Bytes += int64(e.Value.Size())
			}
		}
		if w, ok := wants[typeURL]; ok {
			td.Wildcard = w.wildcard
			names := w.names
			td.NamesTotal = int64(len(names))
			td.Names = slices.Clone(names[:min(len(names), maxNames)])
		}
		out.Types = append(out.Types, td)
	}
	return out, nil
}

// typesOf lists the types a key has a view of or a subscription to, in
// push order, then the rest by type URL.
func typesOf(snap *views.Set, wants map[string]subscription) []string {
	all := map[string]bool{}
	for t := range snap.Types {
		all[t] = true
	}
	for t := range wants {
		all[t] = true
	}
	return slices.SortedFunc(maps.Keys(all), func(a, b string) int {
		ia, ib := slices.Index(xds.PushOrder, a), slices.Index(xds.PushOrder, b)
		if ia < 0 {
			ia = len(xds.PushOrder)
		}
		if ib < 0 {
			ib = len(xds.PushOrder)
		}
		return cmp.Or(cmp.Compare(ia, ib), cmp.Compare(a, b))
	})
}

// streamOf returns the Envoy stream of node and its key (nil if none is
// attached here; the latest to attach if several are).
func (r *Relay) streamOf(node string) (*stream, aggkey.Key) {
	var (
		found *stream
		key   aggkey.Key
	)
	for s, k := range r.srv.attachedStreams() {
		// s.node is set before the stream is attached.
		if s.peerRelay == nil && s.node.GetId() == node && (found == nil || s.id > found.id) {
			found, key = s, k.name()
		}
	}
	return found, key
}

// ConfigDump returns what the relay sent a node, or a key's views, as
// Envoy's config dump with Secrets redacted (see inspectpb.ConfigDump). It
// returns ErrNotHeld for a node not connected here or a key not held.
func (r *Relay) ConfigDump(ctx context.Context, req *inspectpb.ConfigDumpRequest) (*inspectpb.ConfigDump, error) {
	out := &inspectpb.ConfigDump{Relay: r.cfg.ID, Node: req.GetNode(), Key: req.GetKey()}
	var types []configdump.Type
	switch {
	case req.GetNode() != "" && req.GetKey() != "":
		return nil, errors.New("relay: config dump: a node or a key, not both")
	case req.GetNode() != "":
		s, k := r.streamOf(req.GetNode())
		if s == nil {
			return nil, fmt.Errorf("node %q: %w", req.GetNode(), ErrNotHeld)
		}
		out.Key = string(k)
		q := dumpReq{types: req.GetTypes(), reply: make(chan dumpReply, 1)}
		select {
		case s.dumps <- q:
		case <-s.ctx.Done():
			return nil, fmt.Errorf("node %q: %w (its stream ended)", req.GetNode(), ErrNotHeld)
		case <-ctx.Done():
			return nil, fmt.Errorf("node %q: its stream is busy: %w", req.GetNode(), ctx.Err())
		}
		types = (<-q.reply).types
	case req.GetKey() != "":
		k := r.cache.key(aggkey.Key(req.GetKey()))
		if k == nil {
			return nil, fmt.Errorf("key %q: %w", req.GetKey(), ErrNotHeld)
		}
		snap := k.views.Load()
		for _, typeURL := range xds.PushOrder {
			ts := snap.Types[typeURL]
			if ts == nil || len(req.GetTypes()) > 0 && !slices.Contains(req.GetTypes(), typeURL) {
				continue
			}
			types = append(types, configdump.Type{URL: typeURL, Version: ts.View.Root().String(), Entries: slices.Collect(ts.View.All())})
		}
	default:
		return nil, errors.New("relay: config dump: a node or a key is required")
	}
	dump, err := configdump.Build(types)
	if err != nil {
		return nil, err
	}
	if out.ConfigDump, err = anypb.New(dump); err != nil {
		return nil, err
	}
	return out, nil
}

// inspectServer answers the tier's other relays what this one holds.
type inspectServer struct {
	inspectpb.UnimplementedInspectServer
	r    *Relay
	port port
}

func (s inspectServer) GetKey(ctx context.Context, req *inspectpb.KeyRequest) (*inspectpb.KeyDetail, error) {
	if err := s.r.checkPeerCall(ctx, s.port, "inspect"); err != nil {
		return nil, err
	}
	d, err := s.r.KeyDetail(req.GetKey(), int(req.GetMaxNames()))
	return d, inspectStatus(err)
}

func (s inspectServer) GetConfigDump(ctx context.Context, req *inspectpb.ConfigDumpRequest) (*inspectpb.ConfigDump, error) {
	if err := s.r.checkPeerCall(ctx, s.port, "inspect"); err != nil {
		return nil, err
	}
	d, err := s.r.ConfigDump(ctx, req)
	return d, inspectStatus(err)
}

func inspectStatus(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ErrNotHeld):
		return status.Error(codes.NotFound, err.Error())
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return status.Error(codes.DeadlineExceeded, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

// TierKeyDetail returns every relay's account of key (this one's and the
// tier's others', each listing at most maxNames names per type), by relay
// ID; relays that hold no such key are left out, relays that did not
// answer are in missing.
func (r *Relay) TierKeyDetail(ctx context.Context, key string, maxNames int) ([]*inspectpb.KeyDetail, map[string]error) {
	req := &inspectpb.KeyRequest{Key: key, MaxNames: int32(maxNames)}
	got, missing := tierledger.Gather(ctx, r.gatherer, func(ctx context.Context, conn *grpc.ClientConn) (*inspectpb.KeyDetail, error) {
		return inspectpb.NewInspectClient(conn).GetKey(ctx, req, tierledger.MaxAnswer)
	})
	missing = withoutNotFound(missing)
	if d, err := r.KeyDetail(key, maxNames); err == nil {
		got = append(got, d)
	}
	slices.SortFunc(got, func(a, b *inspectpb.KeyDetail) int { return cmp.Compare(a.GetRelay(), b.GetRelay()) })
	return got, missing
}

// TierConfigDump returns the config dump of a node, from the relay it is
// connected to, or of a key, from this relay if it holds the key, else
// from one that does. It returns ErrNotHeld if no relay that answered has
// it (the missing ones may).
func (r *Relay) TierConfigDump(ctx context.Context, req *inspectpb.ConfigDumpRequest) (*inspectpb.ConfigDump, map[string]error, error) {
	d, err := r.ConfigDump(ctx, req)
	if !errors.Is(err, ErrNotHeld) {
		return d, nil, err
	}
	got, missing := tierledger.Gather(ctx, r.gatherer, func(ctx context.Context, conn *grpc.ClientConn) (*inspectpb.ConfigDump, error) {
		// A dump is as large as the key's config: bounded like a response.
		return inspectpb.NewInspectClient(conn).GetConfigDump(ctx, req, grpc.MaxCallRecvMsgSize(r.cfg.MaxMsgSize))
	})
	missing = withoutNotFound(missing)
	if len(got) == 0 {
		return nil, missing, err
	}
	// A node is connected to one relay (two, briefly, while it moves: the
	// answers are alike); a key's holders serve the same views when fresh.
	slices.SortFunc(got, func(a, b *inspectpb.ConfigDump) int { return cmp.Compare(a.GetRelay(), b.GetRelay()) })
	return got[0], missing, nil
}

// withoutNotFound drops, from a gather's failures, the relays that answered
// they hold nothing of what was asked.
func withoutNotFound(missing map[string]error) map[string]error {
	maps.DeleteFunc(missing, func(_ string, err error) bool { return status.Code(err) == codes.NotFound })
	return missing
}

// Stats is a point-in-time summary of a relay, for the demo, the load tests
// and the admin surface.
type Stats struct {
	Streams         int // Envoy streams attached to a key
	PeerClients     int // streams of other relays attached to a key this relay owns
	Keys            int
	StaleKeys       int
	RestoredKeys    int    // keys restored from snapshots at start (warm start)
	UpstreamStreams int    // upstream streams held (owned keys and fallbacks)
	PeerStreams     int    // streams held to other relays, owners of keys
	UpstreamWaiting int    // keys whose upstream stream waits its turn (Config.Upstream.StreamRate)
	Resources       int    // distinct resources in the cache
	Pushes          uint64 // responses sent downstream
	BytesSent       uint64
	PushACKP50      time.Duration
	PushACKP99      time.Duration
	ACKs            uint64
}

// Aggregation reports how well this relay's keys aggregate its Envoys. It
// takes no key's lock. Safe for concurrent use.
func (r *Relay) Aggregation() AggregationReport { return r.cache.aggregation() }

// Splits returns the splits the relay knows, by key, in key order. Safe
// for concurrent use.
func (r *Relay) Splits() []KeySplit { return r.cache.splitList() }

// Stats returns the relay's current figures.
func (r *Relay) Stats() Stats {
	keys := r.cache.heldKeys()
	st := Stats{Keys: len(keys), Resources: r.store.Len(), RestoredKeys: int(r.cache.restored.Load())}
	for _, k := range keys {
		peers := int(k.peers.Load())
		st.Streams += int(k.joined.Load()) - peers
		st.PeerClients += peers
		if k.views.Load().Stale {
			st.StaleKeys++
		}
	}
	st.Pushes = r.metrics.PushCount.Load()
	st.BytesSent = r.metrics.BytesCount.Load()
	st.PushACKP50, st.ACKs = r.srv.pushACK.Quantile(0.50)
	st.PushACKP99, _ = r.srv.pushACK.Quantile(0.99)
	st.UpstreamStreams = int(r.metrics.UpstreamOpen.Load())
	st.PeerStreams = int(r.metrics.PeerOpen.Load())
	st.UpstreamWaiting = int(r.metrics.WaitingOpen.Load())
	return st
}

// ClientStatus is what the relay knows of one connected stream.
type ClientStatus struct {
	NodeID   string
	Key      aggkey.Key
	Protocol Protocol
	Peer     string
	// PeerRelay is the ID of the relay on the other end, for a stream of
	// another relay subscribing to a key this relay owns ("" for Envoys).
	PeerRelay string
	// Types holds the stream's state by type URL.
	Types map[string]TypeStatus
}

// Clients returns the status of every stream attached to a key.
func (r *Relay) Clients() []ClientStatus {
	attached := r.srv.attachedStreams()
	// By node, and streams of one node in the order they came.
	streams := slices.SortedFunc(maps.Keys(attached), func(a, b *stream) int {
		return cmp.Or(strings.Compare(a.node.GetId(), b.node.GetId()), cmp.Compare(a.id, b.id))
	})
	out := make([]ClientStatus, 0, len(streams))
	for _, s := range streams {
		cs := ClientStatus{NodeID: s.node.GetId(), Key: attached[s].name(), Protocol: ProtocolSotW, Peer: s.peer, PeerRelay: s.peerRelayID()}
		if s.delta {
			cs.Protocol = ProtocolDelta
		}
		s.statusMu.Lock()
		cs.Types = make(map[string]TypeStatus, len(s.status))
		for typeURL, st := range s.status {
			cs.Types[typeURL] = *st
		}
		s.statusMu.Unlock()
		out = append(out, cs)
	}
	return out
}
