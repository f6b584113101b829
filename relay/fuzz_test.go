package relay

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	runtimev3 "github.com/envoyproxy/go-control-plane/envoy/service/runtime/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/adsclient"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// The relay decodes three kinds of untrusted input: requests from Envoys
// (FuzzSotWRequests, FuzzDeltaRequests), responses from the upstream
// (FuzzUpstreamResponses, and relay/xds's FuzzDecode of each resource),
// and nodes (relay/aggkey's FuzzKeyProfile and FuzzKeyNamespace). Each
// fuzzer drives the relay's own logic in-process, without the network, and
// checks the protocol's invariants as it goes. Plain `go test` runs only the
// seed corpus: f.Add, and testdata/fuzz/<FuzzName>/, which keeps the inputs
// that found relay bugs, named for what they show. Fuzz with
//
//	go test -run XXX -fuzz FuzzSotWRequests -fuzztime 60s -fuzzminimizetime 200x ./relay/
//
// The stream fuzzers read their input as a sequence of chunks, each a
// control byte, a 2-byte big-endian length and that many bytes of one
// protobuf message. A chunk that does not parse is skipped, as gRPC would
// refuse it before the relay saw it. Bits 0-2 of a request's control byte
// pick the key content to publish after it (see fuzzViews; bit 7: as a
// partial view). Bits 3-6, if not zero, set the request's type URL (see
// fuzzTypes): type URLs are long, and
// short inputs keep the fuzzer fast, above all when it minimizes, which is
// quadratic in the input's length: with the default -fuzzminimizetime (60s
// an input) a run spends most of its time minimizing.

// maxFuzzSteps bounds the messages one input feeds, to keep runs fast.
const maxFuzzSteps = 64

// fuzzChunks splits a fuzz input into (control byte, message bytes) chunks.
// A short last chunk takes what is left.
func fuzzChunks(data []byte) iter.Seq2[byte, []byte] {
	return func(yield func(byte, []byte) bool) {
		for n := 0; len(data) >= 3 && n < maxFuzzSteps; n++ {
			ctl, size := data[0], int(data[1])<<8|int(data[2])
			data = data[3:]
			size = min(size, len(data))
			if !yield(ctl, data[:size]) {
				return
			}
			data = data[size:]
		}
	}
}

// appendChunk encodes one chunk of a seed input.
func appendChunk(tb testing.TB, b []byte, ctl byte, m proto.Message) []byte {
	tb.Helper()
	p, err := proto.Marshal(m)
	if err != nil {
		tb.Fatalf("marshal seed message: %v", err)
	}
	if len(p) > 0xffff {
		tb.Fatalf("seed message of %d bytes does not fit a chunk", len(p))
	}
	return append(append(b, ctl, byte(len(p)>>8), byte(len(p))), p...)
}

// fuzzTypes are the type URLs a request's control byte can set: every
// cached type and Istio's NDS, which passes through.
var fuzzTypes = append(slices.Clone(xds.PushOrder), typeOther)

// typeOfCtl returns the type URL bits 3-6 of ctl set, or "".
func typeOfCtl(ctl byte) string {
	if i := int(ctl>>3) & 0xf; i > 0 && i <= len(fuzzTypes) {
		return fuzzTypes[i-1]
	}
	return ""
}

// ctlOfType moves a seed request's type URL into its control byte.
func ctlOfType(ctl byte, m proto.Message) (byte, proto.Message) {
	m = proto.Clone(m)
	var typeURL *string
	switch r := m.(type) {
	case *discovery.DiscoveryRequest:
		typeURL = &r.TypeUrl
	case *discovery.DeltaDiscoveryRequest:
		typeURL = &r.TypeUrl
	}
	if i := slices.Index(fuzzTypes, *typeURL); i >= 0 {
		ctl |= byte(i+1) << 3
		*typeURL = ""
	}
	return ctl, m
}

func mustAny(m proto.Message) *anypb.Any {
	a, err := anypb.New(m)
	if err != nil {
		panic(err)
	}
	return a
}

func anys(ms ...proto.Message) []*anypb.Any {
	out := make([]*anypb.Any, len(ms))
	for i, m := range ms {
		out[i] = mustAny(m)
	}
	return out
}

// fuzzViews are the key views the stream fuzzers publish. The low 3 bits of
// each chunk's control byte pick one to publish after the request (an
// index past the list, such as fuzzKeep, publishes nothing), so an input
// interleaves requests with changes of the key's content: updates,
// removals, a type appearing, types emptied, a cluster removed before the
// route that uses it, a cluster changed while its endpoints are not or are
// gone.
var fuzzViews = sync.OnceValue(func() []map[string][]*anypb.Any {
	return []map[string][]*anypb.Any{
		{ // 0: two services behind one listener
			xds.TypeCluster:  anys(mkCluster("c0"), mkCluster("c1")),
			xds.TypeEndpoint: anys(mkCLA("c0", 8080), mkCLA("c1", 8080)),
			xds.TypeListener: anys(mkListener("l80", "r80")),
			xds.TypeRoute:    anys(mkRoute("r80", "c0", "c1")),
		},
		{ // 1: c0 changed, c1 gone, c2 and a second listener added
			xds.TypeCluster:  anys(mkCluster("c0", "changed"), mkCluster("c2")),
			xds.TypeEndpoint: anys(mkCLA("c0", 9090), mkCLA("c2", 8080)),
			xds.TypeListener: anys(mkListener("l80", "r80"), mkListener("l81", "r81")),
			xds.TypeRoute:    anys(mkRoute("r80", "c0"), mkRoute("r81", "c2")),
			xds.TypeRuntime:  anys(&runtimev3.Runtime{Name: "rt0", Layer: &structpb.Struct{}}),
		},
		{ // 2: shrunk to one cluster; endpoints and listeners emptied
			xds.TypeCluster:  anys(mkCluster("c0")),
			xds.TypeEndpoint: nil,
			xds.TypeListener: nil,
			xds.TypeRoute:    anys(mkRoute("r80", "c0")),
		},
		{ // 3: c2 removed while route r81 still uses it; c0 changed, its endpoints not
			xds.TypeCluster:  anys(mkCluster("c0", "changed again")),
			xds.TypeEndpoint: anys(mkCLA("c0", 9090)),
			xds.TypeListener: anys(mkListener("l80", "r80"), mkListener("l81", "r81")),
			xds.TypeRoute:    anys(mkRoute("r80", "c0"), mkRoute("r81", "c2")),
		},
		{ // 4: c1 changed while its endpoints are gone
			xds.TypeCluster:  anys(mkCluster("c0"), mkCluster("c1", "changed")),
			xds.TypeEndpoint: anys(mkCLA("c0", 8080)),
			xds.TypeListener: anys(mkListener("l80", "r80")),
			xds.TypeRoute:    anys(mkRoute("r80", "c0", "c1")),
		},
		{ // 5: as 3, c0 changed back
			xds.TypeCluster:  anys(mkCluster("c0")),
			xds.TypeEndpoint: anys(mkCLA("c0", 9090)),
			xds.TypeListener: anys(mkListener("l80", "r80"), mkListener("l81", "r81")),
			xds.TypeRoute:    anys(mkRoute("r80", "c0"), mkRoute("r81", "c2")),
		},
	}
})

// fuzzKeep is the control byte that publishes no view change.
const fuzzKeep = 7

// closedConn is an upstream connection that is already closed. The relay's
// feeds need a *grpc.ClientConn (a nil one panics); on this
// one they run their real code and fail at once, with nothing on the
// network and no gRPC goroutines running behind the fuzzer's back (they
// would make coverage flaky).
func closedConn(tb testing.TB) *grpc.ClientConn {
	tb.Helper()
	conn, err := grpc.NewClient("passthrough:///fuzz-no-upstream", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatal(err)
	}
	conn.Close()
	return conn
}

// downHarness drives one downstream stream's logic in-process: requests go
// to onSotW/onDelta, views are published into the stream's key, sync runs
// after every request, and a fake send checks every response.
//
// The stream attaches through its real first request (attach: Authorizer,
// Keys.Profile, acquireKey, join), which starts the key's feed
// on r.ctx. That goroutine owns the upstream stream and would race the
// harness for the key's views, so r.ctx is set up as Start does but
// cancelled at once: the goroutine starts, sees the context done and exits,
// and release waits for it (r.wg), so nothing leaks. Requests for uncached
// types start the stream's real passthrough goroutine, on a closed
// connection; s.close stops it.
type downHarness struct {
	t     testing.TB
	r     *Relay
	s     *stream
	delta bool

	views  map[int]map[string]ledger.Tree[*xds.Resource] // fuzzViews decoded into r's store
	nonces map[string]bool                               // every nonce sent on the stream
	last   map[string]*wire.Response                     // the latest response, by type
	acked  map[string]string                             // seeds: the latest version ACKed, by type
	// model is what the client holds, by type and name, as the responses
	// and its own requests say (a NACKed response counts as held, as the
	// relay assumes); unknown marks SotW types whose first request claimed
	// a version, so what the client holds is not known.
	model   map[string]map[string]heldRes
	unknown map[string]bool
	// warming lists the endpoints (by name, with their cluster) that must
	// follow in the same sync: their cluster changed, and Envoy warms a
	// changed cluster only when its ClusterLoadAssignment arrives.
	warming map[string]string
	n       int           // requests handled
	cur     proto.Message // the request being handled
	ended   bool          // a request was refused: the stream is over
	closed  bool
}

func newDownHarness(t testing.TB, conn *grpc.ClientConn, delta bool) *downHarness {
	t.Helper()
	// Low enough that fuzzed inputs reach the limit checks.
	r := newTestRelay(t, func(cfg *Config) { cfg.XDS.MaxSubscribedNames = 16 })
	r.upConn = conn
	r.ctx, r.cancel = context.WithCancel(context.Background())
	r.cancel() // see downHarness
	r.cache.start(conn)
	r.srv.start(r.ctx, conn)
	h := &downHarness{
		t: t, r: r, delta: delta,
		views:   make(map[int]map[string]ledger.Tree[*xds.Resource]),
		nonces:  make(map[string]bool),
		last:    make(map[string]*wire.Response),
		acked:   make(map[string]string),
		model:   make(map[string]map[string]heldRes),
		unknown: make(map[string]bool),
		warming: make(map[string]string),
	}
	h.s = r.srv.newStream(context.Background(), delta, portPlain)
	h.s.send = h.checkResponse
	h.s.sendRaw = func(m proto.Message) error {
		t.Fatalf("passthrough answer %v forwarded, but nothing answers upstream", m)
		return nil
	}
	return h
}

// view returns generation gen of fuzzViews, decoded into the relay's store
// the way the upstream client does.
func (h *downHarness) view(gen int) map[string]ledger.Tree[*xds.Resource] {
	if v, ok := h.views[gen]; ok {
		return v
	}
	v := make(map[string]ledger.Tree[*xds.Resource])
	for typeURL, as := range fuzzViews()[gen] {
		b := ledger.Tree[*xds.Resource]{}.Edit()
		for _, a := range as {
			x, err := h.r.store.Decode(typeURL, a, "")
			if err != nil {
				h.t.Fatalf("decode view resource: %v", err)
			}
			b.Set(x.Name, x.Hash, x)
		}
		v[typeURL] = b.Tree()
	}
	h.views[gen] = v
	return v
}

// publish makes generation ctl&7 of fuzzViews the key's content (none past
// the list), keeping the names the key still waits for. The views are the
// full set, as after a wildcard subscription upstream, unless bit 7 of ctl
// is set: then they are only what was asked for by name.
func (h *downHarness) publish(ctl byte) {
	gen := int(ctl & 7)
	k, _ := h.s.key.(*keyState)
	if k == nil || gen >= len(fuzzViews()) {
		return
	}
	published := h.view(gen)
	k.mu.Lock()
	k.update(func(next *views.Set) {
		for typeURL, view := range published {
			ts := next.TypeOf(typeURL)
			ts.View, ts.Ready, ts.Full = view, true, ctl&0x80 == 0
			next.Types[typeURL] = ts
		}
	})
	k.mu.Unlock()
}

// step feeds one chunk: the request, then a view change, then a sync, as
// the stream's handler loop would. It reports whether the stream goes on.
func (h *downHarness) step(ctl byte, msg []byte) bool {
	h.t.Helper()
	var err error
	var typeURL, claimed string
	var declared map[string]string
	if h.delta {
		req := new(discovery.DeltaDiscoveryRequest)
		if proto.Unmarshal(msg, req) != nil {
			return true
		}
		if t := typeOfCtl(ctl); t != "" {
			req.TypeUrl = t
		}
		h.n, h.cur = h.n+1, req
		typeURL, declared = req.GetTypeUrl(), req.GetInitialResourceVersions()
		err = h.s.onDelta(req)
	} else {
		req := new(discovery.DiscoveryRequest)
		if proto.Unmarshal(msg, req) != nil {
			return true
		}
		if t := typeOfCtl(ctl); t != "" {
			req.TypeUrl = t
		}
		h.n, h.cur = h.n+1, req
		typeURL, claimed = req.GetTypeUrl(), req.GetVersionInfo()
		err = h.s.onSotW(req)
	}
	if err != nil {
		// The handler returns err to the client and closes the stream.
		if st, ok := status.FromError(err); !ok || st.Message() == "" ||
			!slices.Contains([]codes.Code{codes.InvalidArgument, codes.PermissionDenied, codes.ResourceExhausted}, st.Code()) {
			h.fatalf("error %v, want a gRPC status (InvalidArgument, PermissionDenied or ResourceExhausted) with a message", err)
		}
		h.ended = true
		return false
	}
	h.clientRequested(typeURL, claimed, declared)
	h.checkState("after the request")
	h.publish(ctl)
	h.sync()
	h.checkState("after the sync")
	h.checkConverged()
	return true
}

// heldRes is a resource the client holds: its version, and the resource if
// the relay knows that content (not for a version the client declared that
// the relay never issued).
type heldRes struct {
	hash ledger.Hash
	res  *xds.Resource
}

// clientRequested updates the model of what the client holds after one of
// its requests: the first request of a type declares what it holds, and a
// client drops what it no longer subscribes to.
func (h *downHarness) clientRequested(typeURL, claimed string, declared map[string]string) {
	sub := h.s.subs[typeURL]
	if sub == nil {
		return
	}
	held := h.model[typeURL]
	if held == nil {
		held = make(map[string]heldRes)
		h.model[typeURL] = held
		for n, v := range declared {
			if hash, _, err := wire.ParseVersion(v); err == nil {
				held[n] = heldRes{hash, h.r.store.Lookup(hash)}
			} else {
				held[n] = heldRes{}
			}
		}
		if claimed != "" {
			h.unknown[typeURL] = true
		}
	}
	if !sub.wildcard {
		maps.DeleteFunc(held, func(n string, _ heldRes) bool { return !sub.names.Has(n) })
	}
}

// checkConverged checks that the client ends up holding what the key has
// for it: every resource it subscribes to, at the key's version, and
// nothing the key no longer has unless that removal must wait (the name is
// still expected from the upstream, or something the client holds still
// refers to it). SotW EDS and RDS cannot say "removed".
//
// A sync may leave a removal for the next one: a removal it holds back in
// its update pass, because a referrer that goes later in the same sync
// still refers to it, is not retried in its removal pass; the client's
// next ACK brings the sync that sends it. So the check first lets the
// stream settle, syncing again (as a wake-up would) while that still sends
// something.
func (h *downHarness) checkConverged() {
	h.t.Helper()
	if h.s.key == nil {
		return
	}
	for range 3 {
		sent := len(h.nonces)
		h.sync()
		if len(h.nonces) == sent {
			break
		}
	}
	snap := h.s.key.published()
	now := time.Now()
	for _, typeURL := range slices.Sorted(maps.Keys(h.s.subs)) {
		sub := h.s.subs[typeURL]
		ts := snap.Types[typeURL]
		if ts == nil || !ts.Ready || h.unknown[typeURL] || (sub.wildcard && !ts.Full) {
			continue // the client waits
		}
		typ := xds.ShortType(typeURL)
		held := h.model[typeURL]
		for e := range ts.View.All() {
			if !sub.wildcard && !sub.names.Has(e.Name) {
				continue
			}
			if have, ok := held[e.Name]; (!ok || have.hash != e.Hash) && !h.s.heldByOrder(typeURL) && !h.s.deferred(typeURL, e.Name) {
				h.fatalf("%s: the key has %q at %.8s, the client holds it: %v at %.8s, and nothing was sent", typ, e.Name, e.Hash, ok, have.hash)
			}
		}
		if !h.delta && !xds.FullStateSotW(typeURL) {
			continue
		}
		for _, n := range slices.Sorted(maps.Keys(held)) {
			if _, ok := ts.View.Get(n); ok || ts.IsPending(n, now, h.r.cfg.XDS.ResourceWaitTimeout) {
				continue
			}
			if h.referredBy(typeURL, n) != "" {
				continue
			}
			if wait, _ := h.s.awaitingDeclarations(typeURL); wait || h.s.heldByOrder(typeURL) {
				continue // a referrer may yet be declared (awaitingDeclarations), or the client holds a newer version
			}
			h.fatalf("%s: the client holds %q, which the key no longer has and nothing refers to, and no removal was sent", typ, n)
		}
	}
}

// sync runs one sync of the stream, then checks that every changed cluster
// the client holds was followed by its endpoints.
func (h *downHarness) sync() {
	h.t.Helper()
	if err := h.s.sync(); err != nil {
		h.fatalf("sync: %v", err)
	}
	for _, e := range slices.Sorted(maps.Keys(h.warming)) {
		if h.wants(xds.TypeEndpoint, e) {
			h.fatalf("cds: cluster %q changed but its endpoints %q did not follow in the same sync: Envoy keeps the cluster warming", h.warming[e], e)
		}
	}
	clear(h.warming)
}

// wants reports whether the client subscribes to name of typeURL, the
// key's view of that type is ready and holds name, and what the client
// holds of the type is known: whether the key has name for the client.
func (h *downHarness) wants(typeURL, name string) bool {
	sub := h.s.subs[typeURL]
	if sub == nil || h.unknown[typeURL] || (!sub.wildcard && !sub.names.Has(name)) {
		return false
	}
	ts := h.s.key.published().Types[typeURL]
	if ts == nil || !ts.Ready || (sub.wildcard && !ts.Full) {
		return false
	}
	_, ok := ts.View.Get(name)
	return ok
}

// referrers lists, for each type, the types whose resources refer to its
// resources, and how: what a removal must wait for.
var referrers = map[string][]struct {
	typeURL string
	kind    xds.RefKind
}{
	xds.TypeCluster:  {{xds.TypeListener, xds.RefClusters}, {xds.TypeRoute, xds.RefClusters}},
	xds.TypeEndpoint: {{xds.TypeCluster, xds.RefEndpoints}},
	xds.TypeRoute:    {{xds.TypeListener, xds.RefRoutes}, {xds.TypeScopedRoute, xds.RefRoutes}},
}

// checkOrder checks a response against what the client holds before it:
// what an update refers to was sent first (make-before-break: clusters
// before the routes that use them), a Delta removal waits until nothing
// the client holds refers to it, and a changed cluster's endpoints are
// noted, to follow.
func (h *downHarness) checkOrder(o *wire.Response) {
	typ := xds.ShortType(o.TypeURL)
	snap := h.s.key.published()
	for _, x := range o.Updated {
		for _, c := range x.Refs(xds.RefClusters) {
			if h.wants(xds.TypeCluster, c) {
				e, _ := snap.Types[xds.TypeCluster].View.Get(c)
				if have := h.model[xds.TypeCluster][c]; have.hash != e.Hash {
					h.fatalf("%s response (nonce %s) sends %q, which uses cluster %q, before that cluster (the client holds it at %.8s, the key at %.8s)",
						typ, o.Nonce, x.Name, c, have.hash, e.Hash)
				}
			}
		}
		if o.TypeURL == xds.TypeCluster {
			if have, ok := h.model[xds.TypeCluster][x.Name]; ok && have.hash != x.Hash {
				for _, e := range x.Refs(xds.RefEndpoints) {
					h.warming[e] = x.Name
				}
			}
		}
		if o.TypeURL == xds.TypeEndpoint {
			delete(h.warming, x.Name)
		}
	}
	removed := o.Removed
	if !h.delta {
		// SotW removes by omission from a full state, and only there.
		removed = nil
		for n := range h.model[o.TypeURL] {
			if o.FullSotW() != nil && !slices.ContainsFunc(o.FullSotW(), func(x *xds.Resource) bool { return x.Name == n }) {
				removed = append(removed, n)
			}
		}
		slices.Sort(removed)
	}
	for _, n := range removed {
		if by := h.referredBy(o.TypeURL, n); by != "" {
			h.fatalf("%s response (nonce %s) removes %q while the client holds %s, which refers to it (make-before-break)", typ, o.Nonce, n, by)
		}
	}
}

// referredBy names a resource the client holds that refers to name of
// typeURL, or returns "". A SotW client is never told that an EDS or RDS
// resource is gone, but drops it with what referred to it: such a resource
// counts only while the key still has it.
func (h *downHarness) referredBy(typeURL, name string) string {
	snap := h.s.key.published()
	for _, ref := range referrers[typeURL] {
		for _, n := range slices.Sorted(maps.Keys(h.model[ref.typeURL])) {
			have := h.model[ref.typeURL][n]
			if have.res == nil || !slices.Contains(have.res.Refs(ref.kind), name) {
				continue
			}
			if !h.delta && !xds.FullStateSotW(ref.typeURL) {
				if ts := snap.Types[ref.typeURL]; ts == nil {
					continue
				} else if _, ok := ts.View.Get(n); !ok {
					continue
				}
			}
			return xds.ShortType(ref.typeURL) + " " + strconv.Quote(n)
		}
	}
	return ""
}

// fatalf fails the test, naming the request being handled.
func (h *downHarness) fatalf(format string, args ...any) {
	h.t.Helper()
	if h.cur == nil {
		h.t.Fatalf("after request %d, once no name is pending: %s", h.n-1, fmt.Sprintf(format, args...))
	}
	h.t.Fatalf("request %d {%v}: %s", h.n, h.cur, fmt.Sprintf(format, args...))
}

// checkResponse is the stream's send: it checks one outgoing response.
func (h *downHarness) checkResponse(o *wire.Response) error {
	typ := xds.ShortType(o.TypeURL)
	sub := h.s.subs[o.TypeURL]
	if sub == nil {
		h.fatalf("response of %s (%s), a type the stream never subscribed to", typ, o.TypeURL)
	}
	if o.Nonce == "" {
		h.fatalf("%s response without a nonce", typ)
	}
	if h.nonces[o.Nonce] {
		h.fatalf("%s response reuses nonce %q on the stream", typ, o.Nonce)
	}
	h.nonces[o.Nonce] = true
	if o.Version == "" {
		h.fatalf("%s response (nonce %s) without a version", typ, o.Nonce)
	}
	if ts := h.s.key.published().Types[o.TypeURL]; sub.wildcard && (ts == nil || !ts.Full) {
		h.fatalf("%s response (nonce %s) to a wildcard subscription from a view that is not the full set", typ, o.Nonce)
	}
	checkRes := func(what string, x *xds.Resource) {
		if x == nil || x.Body == nil {
			h.fatalf("%s response (nonce %s): nil resource in %s", typ, o.Nonce, what)
		}
		if x.Type != o.TypeURL || x.Body.GetTypeUrl() != o.TypeURL {
			h.fatalf("%s response (nonce %s): %s holds %q of type %s", typ, o.Nonce, what, x.Name, x.Type)
		}
		if !sub.wildcard && !sub.names.Has(x.Name) {
			h.fatalf("%s response (nonce %s): %s holds %q, but the stream subscribes only to %v", typ, o.Nonce, what, x.Name, sub.names)
		}
	}
	upd := make(map[string]bool, len(o.Updated))
	for _, x := range o.Updated {
		checkRes("the updates", x)
		if upd[x.Name] {
			h.fatalf("%s response (nonce %s) updates %q twice", typ, o.Nonce, x.Name)
		}
		upd[x.Name] = true
	}
	switch {
	case h.delta:
		removed := make(map[string]bool, len(o.Removed))
		for _, n := range o.Removed {
			if upd[n] {
				h.fatalf("delta %s response (nonce %s) both updates and removes %q", typ, o.Nonce, n)
			}
			if removed[n] {
				h.fatalf("delta %s response (nonce %s) removes %q twice", typ, o.Nonce, n)
			}
			removed[n] = true
		}
		if o.FullSotW() != nil {
			h.fatalf("delta %s response (nonce %s) carries a SotW full state", typ, o.Nonce)
		}
	case xds.FullStateSotW(o.TypeURL):
		if o.FullSotW() == nil {
			h.fatalf("SotW %s response (nonce %s) without its full state", typ, o.Nonce)
		}
		full := make(map[string]bool, len(o.FullSotW()))
		b := ledger.Tree[*xds.Resource]{}.Edit()
		for _, x := range o.FullSotW() {
			checkRes("the full state", x)
			if full[x.Name] {
				h.fatalf("SotW %s response (nonce %s) holds %q twice", typ, o.Nonce, x.Name)
			}
			full[x.Name] = true
			b.Set(x.Name, x.Hash, x)
		}
		for n := range upd {
			if !full[n] {
				h.fatalf("SotW %s response (nonce %s) updates %q but leaves it out of the full state", typ, o.Nonce, n)
			}
		}
		if root := wire.Version(b.Tree().Root(), o.Order); o.Version != root {
			h.fatalf("SotW %s response (nonce %s) has version %s, want the root of its resources %s", typ, o.Nonce, o.Version, root)
		}
	default:
		if o.FullSotW() != nil {
			h.fatalf("SotW %s response (nonce %s) carries a full state for an incremental type", typ, o.Nonce)
		}
	}
	h.checkOrder(o)
	held := h.model[o.TypeURL]
	if held == nil {
		held = make(map[string]heldRes)
		h.model[o.TypeURL] = held
	}
	if o.FullSotW() != nil {
		clear(held)
		for _, x := range o.FullSotW() {
			held[x.Name] = heldRes{x.Hash, x}
		}
		delete(h.unknown, o.TypeURL) // a full state: known again
	}
	for _, x := range o.Updated {
		held[x.Name] = heldRes{x.Hash, x}
	}
	if h.delta {
		for _, n := range o.Removed {
			delete(held, n)
		}
	}
	h.last[o.TypeURL] = o
	return nil
}

// checkState checks the stream's subscriptions against what it holds and
// against the key's union of subscriptions.
func (h *downHarness) checkState(when string) {
	h.t.Helper()
	for typeURL, sub := range h.s.subs {
		if sub.legacy && !sub.wildcard {
			h.fatalf("%s: %s subscription is legacy wildcard but not wildcard", when, xds.ShortType(typeURL))
		}
		if sub.wildcard {
			continue
		}
		for e := range sub.known.All() {
			if !sub.names.Has(e.Name) {
				h.fatalf("%s: %s: the stream holds %q but subscribes only to %v", when, xds.ShortType(typeURL), e.Name, sub.names)
			}
		}
	}
	k, _ := h.s.key.(*keyState)
	if k == nil {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	// One stream is the key's only member, so the key wants exactly what
	// the stream subscribes to: its set, held once.
	for _, typeURL := range slices.Sorted(maps.Keys(k.want)) {
		w := k.want[typeURL]
		if w.wildcard < 0 {
			h.fatalf("%s: key wants %s with a wildcard count of %d", when, xds.ShortType(typeURL), w.wildcard)
		}
		for _, c := range w.sets {
			if c.streams <= 0 || len(c.names) == 0 {
				h.fatalf("%s: key wants %s %v with a count of %d", when, xds.ShortType(typeURL), c.names, c.streams)
			}
		}
		if h.s.subs[typeURL] == nil {
			h.fatalf("%s: key wants %s (wildcard %d, names %v) that the stream never subscribed to", when, xds.ShortType(typeURL), w.wildcard, w.names())
		}
	}
	for typeURL, sub := range h.s.subs {
		w := k.want[typeURL]
		if w == nil {
			w = &typeWant{}
		}
		wantWildcard, wantSets := 0, 0
		if sub.wildcard {
			wantWildcard = 1
		}
		if len(sub.names) > 0 {
			wantSets = 1
		}
		if w.wildcard != wantWildcard || !slices.Equal(w.names(), sub.names) || len(w.sets) != wantSets || w.counts != nil ||
			wantSets == 1 && w.sets[0].streams != 1 {
			h.fatalf("%s: key wants %s {wildcard %d, names %v, sets %d}, want {wildcard %d, names %v in one set counted once} (the stream's subscription)",
				when, xds.ShortType(typeURL), w.wildcard, w.names(), len(w.sets), wantWildcard, sub.names)
		}
	}
}

// release ends the stream as its handler does and waits for every
// goroutine the harness started. It is idempotent.
func (h *downHarness) release() {
	if h.closed {
		return
	}
	h.closed = true
	h.s.close()
	h.r.wg.Wait()
}

// finish lets every name the key waits for expire, as the upstream
// goroutine does after ResourceWaitTimeout, checks that the client then
// converges, ends the stream and checks that the key holds nothing of it.
func (h *downHarness) finish() {
	h.t.Helper()
	if k, _ := h.s.key.(*keyState); k != nil && !h.ended {
		k.mu.Lock()
		k.update(func(next *views.Set) {
			for typeURL, ts := range next.Types {
				if len(ts.Pending) > 0 {
					c := *ts
					c.Pending = nil
					next.Types[typeURL] = &c
				}
			}
		})
		k.mu.Unlock()
		h.n, h.cur = h.n+1, nil
		h.checkConverged()
	}
	h.release()
	k, _ := h.s.key.(*keyState)
	if k == nil {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.members) != 0 {
		h.t.Fatalf("after close the key still has %d members", len(k.members))
	}
	for typeURL, w := range k.want {
		h.t.Fatalf("after close the key still wants %s {wildcard %d, names %v}: the stream's counts were not released", xds.ShortType(typeURL), w.wildcard, w.names())
	}
}

// downStep is one request of a seed, built when the seed is recorded so
// that it can answer the responses before it (nonces, versions).
type downStep struct {
	gen byte // what to publish after the request: a fuzzViews index, or fuzzKeep
	req func(h *downHarness) proto.Message
}

// recordDown runs steps through a harness and returns them as a fuzz input.
func recordDown(tb testing.TB, conn *grpc.ClientConn, delta bool, steps []downStep) []byte {
	tb.Helper()
	h := newDownHarness(tb, conn, delta)
	defer h.release()
	var data []byte
	for _, st := range steps {
		ctl, m := ctlOfType(st.gen, st.req(h))
		start := len(data)
		data = appendChunk(tb, data, ctl, m)
		if !h.step(ctl, data[start+3:]) {
			break
		}
	}
	h.finish()
	return data
}

// fuzzNode is a sidecar's node, as small as the relay serves; istioNode
// carries what istio-agent sends.
var (
	fuzzNode  = &core.Node{Id: "sidecar~10.0.0.1~reviews-0.ns1~ns1.svc.cluster.local"}
	istioNode = node("ns1", "reviews", 0)
)

func plain(gen byte, m proto.Message) downStep {
	return downStep{gen, func(*downHarness) proto.Message { return m }}
}

func sotwReq(typeURL string, names ...string) *discovery.DiscoveryRequest {
	return &discovery.DiscoveryRequest{TypeUrl: typeURL, ResourceNames: names}
}

func sotwFirst(typeURL string, names ...string) *discovery.DiscoveryRequest {
	r := sotwReq(typeURL, names...)
	r.Node = fuzzNode
	return r
}

// sotwAck ACKs the latest response of typeURL, keeping the subscription to
// names.
func sotwAck(gen byte, typeURL string, names ...string) downStep {
	return downStep{gen, func(h *downHarness) proto.Message {
		r := sotwReq(typeURL, names...)
		if o := h.last[typeURL]; o != nil {
			r.VersionInfo, r.ResponseNonce = o.Version, o.Nonce
			h.acked[typeURL] = o.Version
		}
		return r
	}}
}

// sotwNack rejects the latest response of typeURL with the previous ACKed
// version, as Envoy does.
func sotwNack(gen byte, typeURL, detail string, names ...string) downStep {
	return downStep{gen, func(h *downHarness) proto.Message {
		r := sotwReq(typeURL, names...)
		r.VersionInfo = h.acked[typeURL]
		r.ErrorDetail = &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: detail}
		if o := h.last[typeURL]; o != nil {
			r.ResponseNonce = o.Nonce
		}
		return r
	}}
}

func deltaReq(typeURL string, subscribe, unsubscribe []string) *discovery.DeltaDiscoveryRequest {
	return &discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesSubscribe: subscribe, ResourceNamesUnsubscribe: unsubscribe}
}

func deltaFirst(typeURL string, subscribe ...string) *discovery.DeltaDiscoveryRequest {
	r := deltaReq(typeURL, subscribe, nil)
	r.Node = fuzzNode
	return r
}

// deltaAck answers the latest response of typeURL, NACKing it if detail is
// set, and changes the subscription at the same time.
func deltaAck(gen byte, typeURL, detail string, subscribe, unsubscribe []string) downStep {
	return downStep{gen, func(h *downHarness) proto.Message {
		r := deltaReq(typeURL, subscribe, unsubscribe)
		if o := h.last[typeURL]; o != nil {
			r.ResponseNonce = o.Nonce
		}
		if detail != "" {
			r.ErrorDetail = &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: detail}
		}
		return r
	}}
}

// declaredOf returns the content versions of generation gen's resources of
// typeURL, as a client that got them would declare them.
func declaredOf(h *downHarness, gen int, typeURL string) map[string]string {
	out := make(map[string]string)
	for e := range h.view(gen)[typeURL].All() {
		out[e.Name] = e.Hash.String()
	}
	return out
}

var ndsReq = &discovery.DiscoveryRequest{TypeUrl: typeOther, Node: fuzzNode}

func sotwSeeds() [][]downStep {
	eds := []string{"c0", "c1"}
	return [][]downStep{
		// An Envoy starting: CDS wildcard (legacy), EDS for its clusters,
		// LDS wildcard, RDS, each ACKed; then the content changes and the
		// Envoy follows the new clusters and routes; a cluster changes
		// alone (its endpoints must follow) and one goes while a route
		// still uses it.
		{
			plain(0, &discovery.DiscoveryRequest{TypeUrl: xds.TypeCluster, Node: istioNode}),
			sotwAck(0, xds.TypeCluster),
			plain(0, sotwReq(xds.TypeEndpoint, eds...)),
			sotwAck(0, xds.TypeEndpoint, eds...),
			plain(0, sotwReq(xds.TypeListener)),
			sotwAck(0, xds.TypeListener),
			plain(0, sotwReq(xds.TypeRoute, "r80")),
			sotwAck(1, xds.TypeRoute, "r80"),
			sotwAck(fuzzKeep, xds.TypeCluster),
			sotwAck(fuzzKeep, xds.TypeEndpoint, "c0", "c2"),
			sotwAck(fuzzKeep, xds.TypeListener),
			sotwAck(fuzzKeep, xds.TypeRoute, "r80", "r81"),
			sotwAck(3, xds.TypeCluster),
			sotwAck(fuzzKeep, xds.TypeEndpoint, "c0", "c2"),
			sotwAck(2, xds.TypeCluster),
		},
		// A NACK with error_detail, then an ACK of the next version.
		{
			plain(0, sotwFirst(xds.TypeCluster)),
			sotwNack(fuzzKeep, xds.TypeCluster, "cluster c1: invalid outlier detection"),
			sotwNack(1, xds.TypeCluster, "cluster c1: invalid outlier detection"),
			sotwAck(fuzzKeep, xds.TypeCluster),
		},
		// A reconnecting Envoy claims the current CDS version (it is
		// current: nothing to send), and a garbage EDS version.
		{
			{0, func(h *downHarness) proto.Message {
				r := sotwFirst(xds.TypeCluster)
				r.VersionInfo = h.view(0)[xds.TypeCluster].Root().String()
				return r
			}},
			plain(0, &discovery.DiscoveryRequest{TypeUrl: xds.TypeEndpoint, VersionInfo: "v17", ResourceNames: eds}),
			sotwAck(1, xds.TypeCluster),
		},
		// Explicit wildcard with a name, then names only, then wildcard.
		{
			plain(0, sotwFirst(xds.TypeCluster, "*", "c9")),
			sotwAck(fuzzKeep, xds.TypeCluster, "c0"),
			sotwAck(1, xds.TypeCluster, "*"),
			sotwAck(2, xds.TypeCluster, "c0", "c2"),
		},
		// A stale nonce is ignored.
		{
			plain(0, sotwFirst(xds.TypeCluster)),
			plain(1, &discovery.DiscoveryRequest{TypeUrl: xds.TypeCluster, ResponseNonce: "999"}),
			sotwAck(fuzzKeep, xds.TypeCluster),
		},
		// EDS subscribe, unsubscribe one name, then everything.
		{
			plain(0, sotwFirst(xds.TypeEndpoint, eds...)),
			sotwAck(0, xds.TypeEndpoint, "c0"),
			sotwAck(0, xds.TypeEndpoint),
			sotwAck(1, xds.TypeEndpoint, "c2", "c9"),
		},
		// Istio's NDS passes through on the same stream.
		{
			plain(fuzzKeep, ndsReq),
			plain(0, sotwReq(xds.TypeCluster)),
			plain(0, &discovery.DiscoveryRequest{TypeUrl: typeOther, ResponseNonce: "1"}),
			sotwAck(1, xds.TypeCluster),
		},
		// Refused: no node on the first request; no type URL; too many names.
		{plain(0, sotwReq(xds.TypeCluster))},
		{plain(0, &discovery.DiscoveryRequest{Node: fuzzNode})},
		{plain(0, sotwFirst(xds.TypeEndpoint, strings.Split("a b c d e f g h i j k l m n o p q", " ")...))},
	}
}

func deltaSeeds() [][]downStep {
	none := []string(nil)
	return [][]downStep{
		// An Envoy starting, then following a change.
		{
			plain(0, &discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster, Node: istioNode}),
			deltaAck(0, xds.TypeCluster, "", none, none),
			plain(0, deltaReq(xds.TypeEndpoint, []string{"c0", "c1"}, none)),
			deltaAck(0, xds.TypeEndpoint, "", none, none),
			plain(0, deltaReq(xds.TypeListener, none, none)),
			deltaAck(0, xds.TypeListener, "", none, none),
			plain(0, deltaReq(xds.TypeRoute, []string{"r80"}, none)),
			deltaAck(1, xds.TypeRoute, "", none, none),
			deltaAck(fuzzKeep, xds.TypeCluster, "", none, none),
			deltaAck(fuzzKeep, xds.TypeEndpoint, "", []string{"c2"}, []string{"c1"}),
			deltaAck(fuzzKeep, xds.TypeListener, "", none, none),
			deltaAck(fuzzKeep, xds.TypeRoute, "", []string{"r81"}, none),
			deltaAck(3, xds.TypeCluster, "", none, none),
			deltaAck(fuzzKeep, xds.TypeEndpoint, "", none, none),
			deltaAck(2, xds.TypeCluster, "", none, none),
		},
		// A reconnect declaring initial_resource_versions: current
		// versions, garbage, a well-formed version of nothing, and a name
		// it does not subscribe to.
		{
			{0, func(h *downHarness) proto.Message {
				r := deltaFirst(xds.TypeCluster)
				r.InitialResourceVersions = declaredOf(h, 0, xds.TypeCluster)
				r.InitialResourceVersions["c1"] = "garbage"
				r.InitialResourceVersions["c7"] = strings.Repeat("0", 64)
				return r
			}},
			{0, func(h *downHarness) proto.Message {
				r := deltaReq(xds.TypeEndpoint, []string{"c0", "c1"}, nil)
				r.InitialResourceVersions = declaredOf(h, 0, xds.TypeEndpoint)
				r.InitialResourceVersions["c1"] = ""
				r.InitialResourceVersions["c5"] = declaredOf(h, 1, xds.TypeEndpoint)["c2"]
				return r
			}},
			deltaAck(1, xds.TypeCluster, "", none, none),
			deltaAck(fuzzKeep, xds.TypeEndpoint, "", none, none),
		},
		// A NACK with error_detail, then the next version is ACKed.
		{
			plain(0, deltaFirst(xds.TypeCluster)),
			deltaAck(1, xds.TypeCluster, "cluster c1: invalid outlier detection", none, none),
			deltaAck(fuzzKeep, xds.TypeCluster, "", none, none),
		},
		// Wildcard on and off; a name both subscribed and unsubscribed.
		{
			plain(0, deltaFirst(xds.TypeCluster, "*", "c0")),
			deltaAck(fuzzKeep, xds.TypeCluster, "", none, []string{"*"}),
			deltaAck(1, xds.TypeCluster, "", []string{"*", "c1"}, []string{"c0", "c1"}),
			deltaAck(fuzzKeep, xds.TypeCluster, "", []string{"c2"}, []string{"*"}),
			deltaAck(2, xds.TypeCluster, "", none, none),
		},
		// A name subscribed again is sent again (Envoy #22418).
		{
			plain(0, deltaFirst(xds.TypeEndpoint, "c0")),
			deltaAck(fuzzKeep, xds.TypeEndpoint, "", []string{"c0"}, none),
			deltaAck(fuzzKeep, xds.TypeEndpoint, "", none, none),
		},
		// A cluster removed and added back (go-control-plane #583).
		{
			plain(0, deltaFirst(xds.TypeCluster)),
			plain(0, deltaReq(xds.TypeEndpoint, []string{"c0", "c1"}, none)),
			deltaAck(2, xds.TypeCluster, "", none, none),
			deltaAck(0, xds.TypeEndpoint, "", none, none),
			deltaAck(fuzzKeep, xds.TypeCluster, "", none, none),
		},
		// Istio's NDS passes through.
		{
			plain(fuzzKeep, &discovery.DeltaDiscoveryRequest{TypeUrl: typeOther, Node: fuzzNode}),
			plain(0, deltaReq(xds.TypeCluster, none, none)),
			plain(fuzzKeep, &discovery.DeltaDiscoveryRequest{TypeUrl: typeOther, ResponseNonce: "1"}),
		},
		// Refused: no node; no type URL; too many names.
		{plain(0, deltaReq(xds.TypeCluster, none, none))},
		{plain(0, &discovery.DeltaDiscoveryRequest{Node: fuzzNode})},
		{plain(0, deltaFirst(xds.TypeEndpoint, strings.Split("a b c d e f g h i j k l m n o p q", " ")...))},
	}
}

func fuzzDownstream(f *testing.F, delta bool, seeds [][]downStep) {
	conn := closedConn(f)
	for _, steps := range seeds {
		f.Add(recordDown(f, conn, delta, steps))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		h := newDownHarness(t, conn, delta)
		defer h.release()
		for ctl, msg := range fuzzChunks(data) {
			if !h.step(ctl, msg) {
				break
			}
		}
		h.finish()
	})
}

// FuzzSotWRequests feeds a sequence of SotW requests from an Envoy to one
// stream and checks every response and the stream's and key's state.
func FuzzSotWRequests(f *testing.F) { fuzzDownstream(f, false, sotwSeeds()) }

// FuzzDeltaRequests is FuzzSotWRequests for Delta streams.
func FuzzDeltaRequests(f *testing.F) { fuzzDownstream(f, true, deltaSeeds()) }

// upHarness drives one key's upstream client in-process: responses go to
// handle, a fake send records the requests, and a member's subscription
// changes drive resubscribe as the feed's loop would.
type upHarness struct {
	t     testing.TB
	r     *Relay
	k     *keyState
	u     *feed
	delta bool
	reqs  []proto.Message
	acked map[string]string // SotW: the latest version ACKed, by type (the model)
	// The subscription as the upstream sees it, by type. SotW: the names
	// last sent, and whether any request named something (an empty list
	// is the legacy wildcard only until then). Delta: every name
	// subscribed and not unsubscribed since ("*": wildcard, which an empty
	// first request of a legacy type also means).
	names     map[string][]string
	named     map[string]bool
	deltaSubs map[string]map[string]bool
	subs      map[string]bool        // the member's EDS and RDS names, "type|name"
	sets      map[string]xds.NameSet // the member's name sets, by type, as the key holds them
	oracle    *xds.Store             // decodes responses independently of the relay's store
	// streamStart is the index in reqs of a new stream's first request
	// (-1: the harness's first stream, checked on its own).
	streamStart int
}

// The member's subscriptions when the fuzzers start: CDS and LDS wildcard,
// EDS c0 and c1, RDS r80; the ops of upOp change them.
var upInitial = map[string][]string{xds.TypeEndpoint: {"c0", "c1"}, xds.TypeRoute: {"r80"}}

func newUpHarness(t testing.TB, delta bool) *upHarness {
	t.Helper()
	protocol := ProtocolSotW
	if delta {
		protocol = ProtocolDelta
	}
	r := newTestRelay(t, func(cfg *Config) { cfg.Upstream.Protocol = protocol })
	h := &upHarness{
		t: t, r: r, delta: delta, oracle: xds.NewStore(),
		acked: map[string]string{}, names: map[string][]string{}, named: map[string]bool{},
		deltaSubs: map[string]map[string]bool{}, subs: map[string]bool{}, sets: map[string]xds.NameSet{}, streamStart: -1,
	}
	h.k = newKeyState(r.cache, "k")
	// A member whose node the upstream presents. The member is not
	// otherwise driven: the harness subscribes for it.
	m := r.srv.newStream(context.Background(), false, portPlain)
	m.node = fuzzNode
	h.k.join(m)
	h.subscribe(xds.TypeCluster, false, true, nil, nil)
	h.subscribe(xds.TypeListener, false, true, nil, nil)
	h.subs["cds|*"] = true
	for typeURL, names := range upInitial {
		h.subscribe(typeURL, false, false, names, nil)
		for _, n := range names {
			h.subs[typeURL+"|"+n] = true
		}
	}
	h.u = newFeed(h.k)
	h.u.send = func(m proto.Message) error {
		h.reqs = append(h.reqs, proto.Clone(m))
		switch r := m.(type) {
		case *discovery.DiscoveryRequest:
			h.names[r.GetTypeUrl()] = slices.Clone(r.GetResourceNames())
			h.named[r.GetTypeUrl()] = h.named[r.GetTypeUrl()] || len(r.GetResourceNames()) > 0
		case *discovery.DeltaDiscoveryRequest:
			subs := h.deltaSubs[r.GetTypeUrl()]
			if subs == nil {
				subs = map[string]bool{}
				h.deltaSubs[r.GetTypeUrl()] = subs
				if len(r.GetResourceNamesSubscribe()) == 0 && xds.LegacyWildcard(r.GetTypeUrl()) {
					subs[xds.WildcardName] = true
				}
			}
			for _, n := range r.GetResourceNamesSubscribe() {
				subs[n] = true
			}
			for _, n := range r.GetResourceNamesUnsubscribe() {
				delete(subs, n)
			}
		}
		return nil
	}
	// As session does when the stream opens: every subscription is asked.
	h.u.presented = m
	h.drainWake()
	if err := h.u.resubscribe(); err != nil {
		t.Fatalf("resubscribe: %v", err)
	}
	if len(h.reqs) != 4 {
		t.Fatalf("initial subscription sent %d requests, want 4 (CDS, EDS, LDS, RDS)", len(h.reqs))
	}
	for i, m := range h.reqs {
		// The stream puts the node on its first request
		// (adsclient.TestNodeOnFirstRequestOnly), none the feed builds.
		if got := nodeOf(m); got != nil {
			t.Fatalf("initial request %d carries node %v, set by the feed", i, got)
		}
	}
	return h
}

func nodeOf(m proto.Message) *core.Node {
	switch r := m.(type) {
	case *discovery.DiscoveryRequest:
		return r.GetNode()
	case *discovery.DeltaDiscoveryRequest:
		return r.GetNode()
	}
	return nil
}

func (h *upHarness) drainWake() bool {
	select {
	case <-h.k.upWake:
		return true
	default:
		return false
	}
}

// upOp changes the member's subscription by the chunk's control byte, as
// Envoys joining a key or following new clusters do: 1 toggles EDS c2, 2
// EDS c1, 3 RDS r81, 4 CDS between wildcard and c0 alone; others change
// nothing.
func (h *upHarness) upOp(ctl byte) {
	var typeURL, name string
	switch ctl % 8 {
	case 4:
		if h.subs["cds|*"] {
			h.subscribe(xds.TypeCluster, true, false, []string{"c0"}, nil)
		} else {
			h.subscribe(xds.TypeCluster, false, true, nil, []string{"c0"})
		}
		h.subs["cds|*"] = !h.subs["cds|*"]
		return
	case 1:
		typeURL, name = xds.TypeEndpoint, "c2"
	case 2:
		typeURL, name = xds.TypeEndpoint, "c1"
	case 3:
		typeURL, name = xds.TypeRoute, "r81"
	default:
		return
	}
	key := typeURL + "|" + name
	if h.subs[key] {
		h.subscribe(typeURL, false, false, nil, []string{name})
	} else {
		h.subscribe(typeURL, false, false, []string{name}, nil)
	}
	h.subs[key] = !h.subs[key]
}

// subscribe changes the member's subscription to typeURL as a stream does:
// wildcard on or off, names added and removed.
func (h *upHarness) subscribe(typeURL string, wildcardBefore, wildcardAfter bool, added, removed []string) {
	before := h.sets[typeURL]
	after := before.With(added, removed)
	h.k.subscribe(typeURL, wildcardBefore, wildcardAfter, before, after)
	h.sets[typeURL] = after
}

// resubscribe runs the upstream loop's reaction to a wake-up (subscriptions
// or derived names changed) and checks the requests it sends.
func (h *upHarness) resubscribe(when string) {
	t := h.t
	t.Helper()
	n := len(h.reqs)
	woken := false
	// A resubscribe can change the derived names (dropping names from a
	// view) and wake itself again, as the upstream loop would go round.
	for i := 0; h.drainWake(); i++ {
		if i == 4 {
			t.Fatalf("%s: resubscribe keeps waking itself", when)
		}
		err := h.u.resubscribe()
		if errors.Is(err, errResubscribe) {
			// A type became wildcard: the upstream loop opens a new
			// stream, on which everything is asked again.
			h.newStream()
			err = h.u.resubscribe()
		}
		if err != nil {
			t.Fatalf("%s: resubscribe: %v", when, err)
		}
		woken = true
	}
	if !woken {
		return
	}
	for i, m := range h.reqs[n:] {
		if n+i == h.streamStart {
			// The first request of a new stream: the stream puts the
			// node on it (adsclient), not the feed.
			if got := nodeOf(m); got != nil {
				t.Fatalf("%s: the first request of a new stream carries node %v, set by the feed", when, got)
			}
			continue
		}
		switch r := m.(type) {
		case *discovery.DiscoveryRequest:
			if r.GetErrorDetail() != nil || r.GetNode() != nil {
				t.Fatalf("%s: subscription request %v carries error_detail or node", when, r)
			}
			if ut := h.u.types[r.GetTypeUrl()]; r.GetVersionInfo() != h.acked[r.GetTypeUrl()] || r.GetResponseNonce() != ut.nonce {
				t.Fatalf("%s: subscription request has version %q, nonce %q; want the last ACKed %q and the latest nonce %q",
					when, r.GetVersionInfo(), r.GetResponseNonce(), h.acked[r.GetTypeUrl()], ut.nonce)
			}
		case *discovery.DeltaDiscoveryRequest:
			if r.GetErrorDetail() != nil || r.GetNode() != nil || r.GetResponseNonce() != "" {
				t.Fatalf("%s: subscription request %v carries error_detail, node or a nonce", when, r)
			}
		}
	}
	h.checkSubscriptions(when)
	h.checkViews(when)
}

// newStream does what session does when it opens a new upstream stream:
// every type is asked again (the versions and ACKed state are kept), and
// the upstream's view of the subscription starts over.
func (h *upHarness) newStream() {
	for _, ut := range h.u.types {
		ut.asked, ut.nonce, ut.named = false, "", false
	}
	h.names, h.named, h.deltaSubs = map[string][]string{}, map[string]bool{}, map[string]map[string]bool{}
	h.streamStart = len(h.reqs)
}

// checkSubscriptions checks that the upstream is asked for what the key
// needs (the members' subscriptions and the names its views point at), as
// the requests sent add up to.
func (h *upHarness) checkSubscriptions(when string) {
	t := h.t
	t.Helper()
	want := h.u.desired()
	for _, typeURL := range slices.Sorted(maps.Keys(h.u.types)) {
		ut := h.u.types[typeURL]
		if !ut.asked {
			continue
		}
		typ := xds.ShortType(typeURL)
		w := want[typeURL]
		if ut.wildcard != w.wildcard || !slices.Equal(ut.names, xds.NewNameSet(w.names)) {
			t.Fatalf("%s: %s asked {wildcard %v, names %v}, want {wildcard %v, names %v}", when, typ, ut.wildcard, ut.names, w.wildcard, xds.NewNameSet(w.names))
		}
		var names []string
		var wildcard bool
		if h.delta {
			wildcard = h.deltaSubs[typeURL][xds.WildcardName]
			names = slices.Collect(maps.Keys(h.deltaSubs[typeURL]))
		} else {
			names = h.names[typeURL]
			wildcard = slices.Contains(names, xds.WildcardName) || (len(names) == 0 && xds.LegacyWildcard(typeURL) && !h.named[typeURL])
		}
		if wildcard != ut.wildcard || !slices.Equal(xds.NewNameSet(names), ut.names) {
			t.Fatalf("%s: the requests sent subscribe %s to {wildcard %v, names %v}, want {wildcard %v, names %v}",
				when, typ, wildcard, xds.NewNameSet(names), ut.wildcard, ut.names)
		}
	}
}

// decoded is the oracle's reading of a response.
type decoded struct {
	nack    bool
	res     []*xds.Resource
	removed []string
}

// decodeResponse decides, independently of the upstream client, whether a
// response must be NACKed: a resource that does not decode (type, bytes,
// name) or a name that appears twice.
func (h *upHarness) decodeResponse(m proto.Message) decoded {
	var d decoded
	seen := map[string]bool{}
	add := func(typeURL string, a *anypb.Any, name string) {
		x, err := h.oracle.Decode(typeURL, a, name)
		if err != nil || seen[x.Name] {
			d.nack = true
			return
		}
		seen[x.Name] = true
		d.res = append(d.res, x)
	}
	switch resp := m.(type) {
	case *discovery.DiscoveryResponse:
		for _, a := range resp.GetResources() {
			add(resp.GetTypeUrl(), a, "")
		}
	case *discovery.DeltaDiscoveryResponse:
		for _, r := range resp.GetResources() {
			if r.GetResource() != nil { // nil: a TTL heartbeat
				add(resp.GetTypeUrl(), r.GetResource(), r.GetName())
			}
		}
		d.removed = resp.GetRemovedResources()
	}
	return d
}

// response feeds one upstream response and checks the request that answers
// it and the key's views.
func (h *upHarness) response(msg []byte) {
	t := h.t
	t.Helper()
	var m proto.Message
	var typeURL, nonce, version string
	if h.delta {
		resp := new(discovery.DeltaDiscoveryResponse)
		if proto.Unmarshal(msg, resp) != nil {
			return
		}
		m, typeURL, nonce = resp, resp.GetTypeUrl(), resp.GetNonce()
	} else {
		resp := new(discovery.DiscoveryResponse)
		if proto.Unmarshal(msg, resp) != nil {
			return
		}
		m, typeURL, nonce, version = resp, resp.GetTypeUrl(), resp.GetNonce(), resp.GetVersionInfo()
	}
	typ := xds.ShortType(typeURL)
	want := h.decodeResponse(m)
	before := h.k.views.Load()
	names := h.names[typeURL]
	n := len(h.reqs)
	asked := h.u.types[typeURL] != nil && h.u.types[typeURL].asked
	// The feed reads it as its stream does (wire.Codec's lazy reader).
	var in adsclient.Response = new(wire.SotWIn)
	if h.delta {
		in = new(wire.DeltaIn)
	}
	if err := wire.NewCodec().Unmarshal(mem.BufferSlice{mem.SliceBuffer(msg)}, in); err != nil {
		t.Fatalf("the feed's reader refuses what proto reads (%v): %v", m, err)
	}
	if err := h.u.handle(in); err != nil {
		t.Fatalf("handle %v: %v", m, err)
	}
	if !h.delta && !asked {
		// SotW: a response for a type never asked for is not answered (an
		// ACK would subscribe to it) and changes nothing.
		if got := len(h.reqs) - n; got != 0 || h.k.views.Load() != before {
			t.Fatalf("unsolicited %s response got %d requests back or changed the views", typ, got)
		}
		return
	}
	if got := len(h.reqs) - n; got != 1 {
		t.Fatalf("%s response (nonce %q) got %d requests back, want exactly one (ACK or NACK)", typ, nonce, got)
	}
	var detail *rpcstatus.Status
	switch r := h.reqs[n].(type) {
	case *discovery.DiscoveryRequest:
		detail = r.GetErrorDetail()
		if r.GetTypeUrl() != typeURL || r.GetResponseNonce() != nonce || r.GetNode() != nil {
			t.Fatalf("%s response (nonce %q) answered by %v", typ, nonce, r)
		}
		wantVersion := version // an ACK names the version it accepts
		if detail != nil {
			wantVersion = h.acked[typeURL] // a NACK, the previous one
		}
		if r.GetVersionInfo() != wantVersion {
			t.Fatalf("%s response (version %q, nonce %q) answered with version %q, want %q (NACK: %v)",
				typ, version, nonce, r.GetVersionInfo(), wantVersion, detail != nil)
		}
		if h.u.types[typeURL].asked && !slices.Equal(r.GetResourceNames(), names) {
			t.Fatalf("%s ACK or NACK changes the subscription: names %q, want %q as before", typ, r.GetResourceNames(), names)
		}
		if detail == nil {
			h.acked[typeURL] = version
		}
	case *discovery.DeltaDiscoveryRequest:
		detail = r.GetErrorDetail()
		if r.GetTypeUrl() != typeURL || r.GetResponseNonce() != nonce || r.GetNode() != nil ||
			len(r.GetResourceNamesSubscribe())+len(r.GetResourceNamesUnsubscribe())+len(r.GetInitialResourceVersions()) > 0 {
			t.Fatalf("%s response (nonce %q) answered by %v", typ, nonce, r)
		}
	}
	if detail != nil && (detail.GetMessage() == "" || codes.Code(detail.GetCode()) != codes.InvalidArgument) {
		t.Fatalf("%s NACK has error_detail %v, want InvalidArgument with a message", typ, detail)
	}
	if want.nack != (detail != nil) {
		t.Fatalf("%s response (nonce %q): NACK = %v, want %v (%d resources decode)", typ, nonce, detail != nil, want.nack, len(want.res))
	}
	if detail != nil {
		if h.k.views.Load() != before {
			t.Fatalf("%s response (nonce %q) was NACKed but the key's views changed", typ, nonce)
		}
	} else {
		h.checkApplied(typeURL, want)
	}
	h.checkViews(fmt.Sprintf("after %s response (nonce %q)", typ, nonce))
}

// checkApplied checks that an ACKed response is what the key's view of its
// type now shows.
func (h *upHarness) checkApplied(typeURL string, d decoded) {
	t := h.t
	t.Helper()
	ut := h.u.types[typeURL]
	if !ut.asked {
		return
	}
	typ := xds.ShortType(typeURL)
	view := h.k.views.Load().Types[typeURL].View
	wanted := func(name string) bool { return ut.wildcard || ut.names.Has(name) }
	removed := xds.NewNameSet(d.removed)
	sent := map[string]bool{}
	for _, x := range d.res {
		if !wanted(x.Name) {
			continue
		}
		sent[x.Name] = true
		e, ok := view.Get(x.Name)
		switch {
		case removed.Has(x.Name):
			if ok {
				t.Fatalf("%s: %q updated and removed by one response, but the view holds it", typ, x.Name)
			}
		case !ok || e.Hash != x.Hash:
			t.Fatalf("%s: ACKed %q at %s, but the view holds %v at %s", typ, x.Name, x.Hash, ok, e.Hash)
		}
	}
	for _, n := range d.removed {
		if _, ok := view.Get(n); ok {
			t.Fatalf("%s: ACKed the removal of %q, but the view holds it", typ, n)
		}
	}
	if !h.delta && xds.FullStateSotW(typeURL) {
		for e := range view.All() {
			if !sent[e.Name] {
				t.Fatalf("%s: ACKed a full state without %q, but the view holds it", typ, e.Name)
			}
		}
	}
}

// checkViews checks the key's views: every resource is what its hash says,
// under its own name and type; only types asked for have content, and only
// the names asked for; the derived names follow the views.
func (h *upHarness) checkViews(when string) {
	t := h.t
	t.Helper()
	snap := h.k.views.Load()
	for typeURL, ts := range snap.Types {
		typ := xds.ShortType(typeURL)
		ut := h.u.types[typeURL]
		for e := range ts.View.All() {
			x := e.Value
			if x == nil || x.Body == nil {
				t.Fatalf("%s: %s view holds %q without a resource", when, typ, e.Name)
			}
			if x.Name != e.Name || x.Hash != e.Hash || x.Type != typeURL || x.Body.GetTypeUrl() != typeURL ||
				xds.ContentHash(typeURL, x.Body.GetValue()) != e.Hash {
				t.Fatalf("%s: %s view holds %q at %s, but the resource is %q of type %s at %s (content %s)",
					when, typ, e.Name, e.Hash, x.Name, x.Type, x.Hash, xds.ContentHash(typeURL, x.Body.GetValue()))
			}
			if ut == nil || !ut.asked {
				t.Fatalf("%s: %s view holds %q, but the type was never asked for", when, typ, e.Name)
			}
			if !ut.wildcard && !ut.names.Has(e.Name) {
				t.Fatalf("%s: %s view holds %q, but the upstream was asked only for %v", when, typ, e.Name, ut.names)
			}
		}
		if h.delta && ut != nil && ut.asked {
			var names []string
			for e := range ts.View.All() {
				names = append(names, e.Name)
			}
			slices.Sort(names)
			var got []string
			for e := range ut.versions.All() {
				got = append(got, e.Name)
			}
			if slices.Sort(got); !slices.Equal(got, names) {
				t.Fatalf("%s: %s: the versions kept for initial_resource_versions are of %q, but the view holds %q", when, typ, got, names)
			}
		}
	}
	for target, sources := range map[string][]string{xds.TypeEndpoint: {xds.TypeCluster}, xds.TypeRoute: {xds.TypeListener, xds.TypeScopedRoute}} {
		kind := xds.RefEndpoints
		if target == xds.TypeRoute {
			kind = xds.RefRoutes
		}
		want := map[string]int{}
		for _, typeURL := range sources {
			if ts := snap.Types[typeURL]; ts != nil {
				for e := range ts.View.All() {
					for _, n := range e.Value.Refs(kind) {
						want[n]++
					}
				}
			}
		}
		if got := h.u.derived[target]; !maps.Equal(got, want) {
			t.Fatalf("%s: derived %s names %v, want %v (what the views point at)", when, xds.ShortType(target), got, want)
		}
		if set, ok := h.u.derivedSets[target]; ok && !slices.Equal(set, slices.Sorted(maps.Keys(want))) {
			t.Fatalf("%s: the set of derived %s names %v, want %v (a stale set)", when, xds.ShortType(target), set, slices.Sorted(maps.Keys(want)))
		}
	}
}

func sotwResp(typeURL, version, nonce string, ms ...proto.Message) *discovery.DiscoveryResponse {
	return &discovery.DiscoveryResponse{TypeUrl: typeURL, VersionInfo: version, Nonce: nonce, Resources: anys(ms...)}
}

func deltaResp(typeURL, nonce string, removed []string, ms ...proto.Message) *discovery.DeltaDiscoveryResponse {
	r := &discovery.DeltaDiscoveryResponse{TypeUrl: typeURL, Nonce: nonce, RemovedResources: removed, SystemVersionInfo: "sys-" + nonce}
	for _, m := range ms {
		n := cache.GetResourceName(m)
		r.Resources = append(r.Resources, &discovery.Resource{Name: n, Version: "v-" + nonce + "-" + n, Resource: mustAny(m)})
	}
	return r
}

// upChunk is one chunk of an upstream seed: an op (see upOp), then a
// response.
type upChunk struct {
	op   byte
	resp proto.Message
}

func upSeed(tb testing.TB, delta bool, chunks ...upChunk) []byte {
	data := []byte{0}
	if delta {
		data[0] = 1
	}
	for _, c := range chunks {
		data = appendChunk(tb, data, c.op, c.resp)
	}
	return data
}

// FuzzUpstreamResponses feeds a sequence of upstream responses (SotW if the
// input's first byte is even, Delta if odd) to one key's upstream client and
// checks every answer and the key's views.
func FuzzUpstreamResponses(f *testing.F) {
	garbage := &anypb.Any{TypeUrl: xds.TypeCluster, Value: []byte("\x0a\xff\xff garbage")}
	named := func(name string, m proto.Message) *discovery.Resource {
		return &discovery.Resource{Name: name, Version: "v1", Resource: mustAny(m)}
	}
	// SotW: a CDS response with three clusters, their endpoints (some in
	// a later, partial EDS response), listener and route, then a cluster
	// goes.
	f.Add(upSeed(f, false,
		upChunk{0, sotwResp(xds.TypeCluster, "v1", "n1", mkCluster("c0"), mkCluster("c1"), mkCluster("c2"))},
		upChunk{0, sotwResp(xds.TypeEndpoint, "v1", "n2", mkCLA("c0", 8080), mkCLA("c1", 8080))},
		upChunk{1, sotwResp(xds.TypeEndpoint, "v2", "n3", mkCLA("c2", 8080))},
		upChunk{0, sotwResp(xds.TypeListener, "v1", "n4", mkListener("l80", "r80"))},
		upChunk{0, sotwResp(xds.TypeRoute, "v1", "n5", mkRoute("r80", "c0", "c1", "c2"))},
		upChunk{2, sotwResp(xds.TypeCluster, "v2", "n6", mkCluster("c0"), mkCluster("c2"))},
		upChunk{0, sotwResp(xds.TypeEndpoint, "v3", "n7", mkCLA("c0", 9090))},
	))
	// SotW: responses the relay must NACK, each followed by a good one.
	badCDS := sotwResp(xds.TypeCluster, "v2", "n2", mkCluster("c0"))
	badCDS.Resources = append(badCDS.Resources, garbage)
	f.Add(upSeed(f, false,
		upChunk{0, sotwResp(xds.TypeCluster, "v1", "n1", mkCluster("c0"))},
		upChunk{0, badCDS},
		upChunk{0, sotwResp(xds.TypeCluster, "v3", "n3", mkCluster("c0"), mkCluster("c0"))}, // a name twice
		upChunk{0, sotwResp(xds.TypeCluster, "v4", "n4", &core.Node{Id: "x"})},              // no name
		upChunk{0, sotwResp(xds.TypeEndpoint, "v1", "n5", mkCluster("c0"))},                 // type mismatch
		upChunk{0, sotwResp(xds.TypeCluster, "v5", "n6", mkCluster("c0"), mkCluster("c1"))},
	))
	// SotW: unsolicited and unknown types, names nobody asked for.
	f.Add(upSeed(f, false,
		upChunk{0, sotwResp(xds.TypeScopedRoute, "v1", "n1")},
		upChunk{0, sotwResp(typeOther, "v1", "n2", &structpb.Struct{})},
		upChunk{0, sotwResp("", "", "")},
		upChunk{0, sotwResp(xds.TypeEndpoint, "v1", "n3", mkCLA("c9", 8080), mkCLA("c0", 1))},
		upChunk{3, sotwResp(xds.TypeRoute, "v1", "n4", mkRoute("r81", "c0"), mkRoute("r99"))},
	))
	// Delta: CDS, then EDS with an update and a removal.
	f.Add(upSeed(f, true,
		upChunk{0, deltaResp(xds.TypeCluster, "n1", nil, mkCluster("c0"), mkCluster("c1"), mkCluster("c2"))},
		upChunk{1, deltaResp(xds.TypeEndpoint, "n2", nil, mkCLA("c0", 8080), mkCLA("c1", 8080), mkCLA("c2", 8080))},
		upChunk{0, deltaResp(xds.TypeEndpoint, "n3", []string{"c1"}, mkCLA("c0", 9090))},
		upChunk{0, deltaResp(xds.TypeCluster, "n4", []string{"c1"})},
		upChunk{0, deltaResp(xds.TypeListener, "n5", nil, mkListener("l80", "r80"))},
		upChunk{3, deltaResp(xds.TypeRoute, "n6", nil, mkRoute("r80", "c0"))},
	))
	// Delta: a name that does not match its resource, a TTL heartbeat, an
	// update and a removal of one name, a removal of something unknown.
	mismatch := deltaResp(xds.TypeCluster, "n2", nil)
	mismatch.Resources = []*discovery.Resource{named("c1", mkCluster("c0"))}
	heartbeat := deltaResp(xds.TypeCluster, "n3", nil)
	heartbeat.Resources = []*discovery.Resource{{Name: "c0", Version: "v1"}}
	f.Add(upSeed(f, true,
		upChunk{0, deltaResp(xds.TypeCluster, "n1", nil, mkCluster("c0"))},
		upChunk{0, mismatch},
		upChunk{0, heartbeat},
		upChunk{2, deltaResp(xds.TypeEndpoint, "n4", []string{"c0"}, mkCLA("c0", 1))},
		upChunk{0, deltaResp(xds.TypeEndpoint, "n5", []string{"c7"})},
		upChunk{0, deltaResp(typeOther, "n6", nil, &structpb.Struct{})},
	))

	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		h := newUpHarness(t, data[0]%2 == 1)
		defer h.u.stopTimers()
		h.reqs = nil
		for ctl, msg := range fuzzChunks(data[1:]) {
			h.upOp(ctl)
			h.resubscribe("after a subscription change")
			h.response(msg)
			h.resubscribe("after the views changed")
		}
	})
}

// FuzzParseVersion: a wire version comes back from clients. It parses to a
// hash and an Order that render to a version that parses the same (a bare
// hash with the zero Order), or fails; it never panics.
func FuzzParseVersion(f *testing.F) {
	h := ledger.HashBytes([]byte("c0"))
	s := ledger.StampAt(time.UnixMilli(1764574155123))
	for _, v := range []string{h.String(), wire.Version(h, ledger.Order{}), wire.Version(h, ledger.Order{Session: s, At: s + 2}), h.String() + "@", "@1.0/1.0", "x@1.0/1.0", h.String() + "@1.2/1.3", h.String() + "@2.0/1.0"} {
		f.Add(v)
	}
	f.Fuzz(func(t *testing.T, v string) {
		hash, o, err := wire.ParseVersion(v)
		if err != nil {
			return
		}
		if !strings.Contains(v, "@") && !o.IsZero() {
			t.Fatalf("ParseVersion(%q) = %s, %v; want no order on a bare hash", v, hash, o)
		}
		again := wire.Version(hash, o)
		if h2, o2, err := wire.ParseVersion(again); err != nil || h2 != hash || o2 != o {
			t.Fatalf("ParseVersion(%q) = %s, %v, rendered %q, which parses as %s, %v, %v", v, hash, o, again, h2, o2, err)
		}
	})
}
