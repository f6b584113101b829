package wire

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// decodeMessage marshals m as the relay's server does and decodes it as a
// client would.
func decodeMessage[M proto.Message](t *testing.T, m *Message, into M) M {
	t.Helper()
	data, err := NewCodec().Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if err := proto.Unmarshal(data.Materialize(), into); err != nil {
		t.Fatalf("a client cannot decode the message: %v", err)
	}
	return into
}

func resources(t *testing.T, names ...string) (ledger.Tree[*xds.Resource], []*xds.Resource) {
	t.Helper()
	store := xds.NewStore()
	b := ledger.Tree[*xds.Resource]{}.Edit()
	var out []*xds.Resource
	for _, n := range names {
		a, err := anypb.New(&cluster.Cluster{Name: n})
		if err != nil {
			t.Fatal(err)
		}
		r, err := store.Decode(xds.TypeCluster, a, "")
		if err != nil {
			t.Fatal(err)
		}
		b.Set(r.Name, r.Hash, r)
		out = append(out, r)
	}
	return b.Tree(), out
}

// A SotW response decodes as the DiscoveryResponse it stands for; two
// keys' responses of the same content and different Orders share one body
// and differ in their version_info alone.
func TestSotWResponses(t *testing.T) {
	var bodies Bodies
	cp, err := proto.Marshal(&core.ControlPlane{Identifier: "relay-1"})
	if err != nil {
		t.Fatal(err)
	}
	held, _ := resources(t, "c0", "c1")
	o1 := ledger.Order{Session: 1 << 20, At: 2 << 20}
	o2 := ledger.Order{Session: 3 << 20, At: 4 << 20}
	r1 := &Response{TypeURL: xds.TypeCluster, Full: true, Held: held, To: held.Root(), Order: o1, Version: Version(held.Root(), o1), Nonce: "7"}
	r2 := &Response{TypeURL: xds.TypeCluster, Full: true, Held: held, To: held.Root(), Order: o2, Version: Version(held.Root(), o2), Nonce: "9"}
	m1, m2 := bodies.SotW(r1, cp), bodies.SotW(r2, cp)
	if &m1.parts[1].ReadOnlyData()[0] != &m2.parts[1].ReadOnlyData()[0] {
		t.Fatal("two keys' responses of the same content do not share a body")
	}
	for _, tc := range []struct {
		m    *Message
		r    *Response
		want string
	}{{m1, r1, "7"}, {m2, r2, "9"}} {
		got := decodeMessage(t, tc.m, &discovery.DiscoveryResponse{})
		if got.GetVersionInfo() != tc.r.Version || got.GetNonce() != tc.want || got.GetTypeUrl() != xds.TypeCluster ||
			got.GetControlPlane().GetIdentifier() != "relay-1" || len(got.GetResources()) != 2 {
			t.Fatalf("decoded %v, want version %s, nonce %s, 2 clusters, the relay's control plane", got, tc.r.Version, tc.want)
		}
		if tc.m.Size() != proto.Size(got) {
			t.Fatalf("Size() = %d, want the encoded %d", tc.m.Size(), proto.Size(got))
		}
	}
}

// A Delta response decodes as the DeltaDiscoveryResponse it stands for,
// every resource's version carrying the view's Order.
func TestDeltaResponse(t *testing.T) {
	var bodies Bodies
	view, upd := resources(t, "c0", "c1")
	o := ledger.Order{Session: 1 << 20, At: 2 << 20}
	r := &Response{TypeURL: xds.TypeCluster, Updated: upd, Removed: []string{"gone"}, To: view.Root(), View: view.Root(), Order: o, Version: Version(view.Root(), o), Nonce: "3"}
	got := decodeMessage(t, bodies.Delta(r, nil), &discovery.DeltaDiscoveryResponse{})
	if got.GetSystemVersionInfo() != r.Version || got.GetNonce() != "3" || len(got.GetResources()) != 2 || len(got.GetRemovedResources()) != 1 {
		t.Fatalf("decoded %v", got)
	}
	for i, res := range got.GetResources() {
		if res.GetName() != upd[i].Name || res.GetVersion() != Version(upd[i].Hash, o) {
			t.Fatalf("resource %d: %s at %s, want %s at %s", i, res.GetName(), res.GetVersion(), upd[i].Name, Version(upd[i].Hash, o))
		}
	}
}

// A Delta response that only removes is sent to an Envoy with one resource
// it holds again (its version carries the removal's Order), to another
// relay without: the same transition at the same Order, two bodies. A peer
// relay's body once went to an Envoy, which then declared only older
// Orders on reconnect and was sent a removed cluster back (the
// simulation's seed 2705 of issue 28).
func TestDeltaRemovalCarrierIsPartOfTheBody(t *testing.T) {
	var bodies Bodies
	view, held := resources(t, "c0")
	o := ledger.Order{Session: 1 << 20, At: 2 << 20}
	bare := &Response{TypeURL: xds.TypeCluster, Removed: []string{"gone"}, From: ledger.Hash{1}, To: view.Root(), View: view.Root(), Order: o, Nonce: "1"}
	carried := *bare
	carried.Updated, carried.Carried = held, held[0].Hash
	for _, first := range []*Response{bare, &carried} { // whichever is encoded first
		bodies = Bodies{}
		_ = bodies.Delta(first, nil)
		if got := decodeMessage(t, bodies.Delta(&carried, nil), &discovery.DeltaDiscoveryResponse{}); len(got.GetResources()) != 1 {
			t.Fatalf("the Envoy's removal carries %d resources, want the one held", len(got.GetResources()))
		}
		if got := decodeMessage(t, bodies.Delta(bare, nil), &discovery.DeltaDiscoveryResponse{}); len(got.GetResources()) != 0 {
			t.Fatalf("the relay's removal carries %d resources, want none", len(got.GetResources()))
		}
	}
}

// A body wanted by many streams at once is encoded once; one not used for
// two periods is let go, one used again is kept.
func TestBodiesOnceAndAging(t *testing.T) {
	now := time.Unix(1_000, 0)
	c := &Bodies{now: func() time.Time { return now }}
	k := func(i byte) bodyKey { return bodyKey{typeURL: xds.TypeCluster, to: ledger.Hash{i}} }
	var encodes atomic.Int32
	release := make(chan struct{})
	var wg sync.WaitGroup
	defer wg.Wait()
	stop := sync.OnceFunc(func() { close(release) })
	defer stop() // also when the test fails first
	for range 10 {
		wg.Go(func() {
			e := c.get(k(1), func() []byte { encodes.Add(1); <-release; return []byte("body-1") })
			if string(e.b) != "body-1" {
				t.Errorf("get = %q, want body-1", e.b)
			}
		})
	}
	for deadline := time.Now().Add(10 * time.Second); c.waiting(k(1)) == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) { // until the first has started encoding
			t.Fatal("no stream started encoding the body")
		}
	}
	stop()
	wg.Wait()
	if n := encodes.Load(); n != 1 {
		t.Fatalf("the body was encoded %d times for 10 streams at once, want 1", n)
	}
	enc := func(s string) func() []byte { return func() []byte { encodes.Add(1); return []byte(s) } }
	twice := func(k bodyKey, s string) { c.get(k, enc(s)); c.get(k, enc(s)) } // asked again: held
	now = now.Add(bodyAge + time.Second)
	twice(k(2), "body-2") // a new period: body-1 is old, body-2 current
	now = now.Add(bodyAge + time.Second)
	twice(k(1), "again") // body-1 is gone: encoded again
	if n, bytes := c.Len(); n != 2 || bytes != len("body-2")+len("again") {
		t.Fatalf("Len = %d bodies, %d bytes; want body-2 (old) and body-1 again (current)", n, bytes)
	}
	now = now.Add(bodyAge + time.Second)
	c.get(k(1), enc("x")) // used again: kept
	now = now.Add(bodyAge + time.Second)
	twice(k(3), "body-3")
	if n, _ := c.Len(); n != 2 {
		t.Fatalf("Len = %d, want body-1 (used a period ago) and body-3; body-2 unused for two periods is gone", n)
	}
	if got := encodes.Load(); got != 4 {
		t.Fatalf("encodes = %d, want 4 (body-1, body-2, body-1 again, body-3)", got)
	}
}

// A body asked for once is held only as long as something else holds it
// (its messages on their way out): a per-node key's Delta body is its one
// stream's. Asked for again, it is shared if still alive, else encoded
// again, and held from then on.
func TestBodiesAskedOnceHeldWeakly(t *testing.T) {
	c := &Bodies{}
	k := bodyKey{delta: true, typeURL: xds.TypeEndpoint, to: ledger.Hash{1}}
	var encodes int
	enc := func() []byte { encodes++; return []byte(strings.Repeat("a body larger than a tiny allocation ", 4)) }

	first := c.get(k, enc)
	if n, bytes := c.Len(); n != 0 || bytes != 0 {
		t.Fatalf("asked for once: Len = %d bodies, %d bytes; want none held", n, bytes)
	}
	if again := c.get(k, enc); encodes != 1 || &again.b[0] != &first.b[0] {
		t.Fatalf("asked again while its first message lives: %d encodings, same bytes %v; want 1, true", encodes, &again.b[0] == &first.b[0])
	}
	if n, _ := c.Len(); n != 1 {
		t.Fatalf("asked for twice: Len = %d, want 1 held", n)
	}

	k.to = ledger.Hash{2}
	c.get(k, enc) // its message gone at once
	runtime.GC()
	runtime.GC()
	c.get(k, enc)
	if encodes != 3 {
		t.Fatalf("asked again once its message was gone: %d encodings, want 3 (encoded again)", encodes)
	}
	runtime.GC()
	c.get(k, enc)
	if encodes != 3 {
		t.Fatalf("asked a third time: %d encodings, want 3 (held since the second)", encodes)
	}
}

// A stream's message of a cached body costs a few small allocations, the
// same for a 1 MB body as for a small one: the body is neither copied nor
// boxed per stream.
func TestMessageAllocations(t *testing.T) {
	var bodies Bodies
	for _, n := range []int{1, 1000} {
		names := make([]string, n)
		for i := range names {
			names[i] = fmt.Sprintf("outbound|80||svc-%d.ns.svc.cluster.local", i)
		}
		held, upd := resources(t, names...)
		o := ledger.Order{Session: 1 << 20, At: 2 << 20}
		sotw := &Response{TypeURL: xds.TypeCluster, Full: true, Held: held, To: held.Root(), Order: o, Version: Version(held.Root(), o), Nonce: "12"}
		delta := &Response{TypeURL: xds.TypeCluster, Updated: upd, To: held.Root(), View: held.Root(), Order: o, Version: sotw.Version, Nonce: "12"}
		codec := NewCodec()
		bodies.SotW(sotw, nil) // encoded once
		bodies.Delta(delta, nil)
		for _, tc := range []struct {
			name string
			send func() *Message
		}{
			{"SotW", func() *Message { return bodies.SotW(sotw, nil) }},
			{"Delta", func() *Message { return bodies.Delta(delta, nil) }},
		} {
			allocs := testing.AllocsPerRun(100, func() {
				if _, err := codec.Marshal(tc.send()); err != nil {
					t.Fatal(err)
				}
			})
			if allocs > 3 {
				t.Errorf("%s, %d resources: %.0f allocations per stream's message of a cached body, want 3 at most", tc.name, n, allocs)
			}
		}
	}
}

// A Delta body is encoded into a buffer of its exact size: none grown
// (a copy of the whole body), none with room to spare.
func TestDeltaBodyExactSize(t *testing.T) {
	names := make([]string, 300)
	for i := range names {
		names[i] = fmt.Sprintf("outbound|80||svc-%d.ns.svc.cluster.local", i)
	}
	view, upd := resources(t, names...)
	for _, o := range []ledger.Order{{}, {Session: 1 << 40, At: 3<<40 + 7, Mixed: true}} {
		r := &Response{TypeURL: xds.TypeCluster, Updated: upd, Removed: []string{"gone", ""}, To: view.Root(), View: view.Root(), Order: o, Version: Version(view.Root(), o)}
		b := encodeDelta(r, nil)
		if len(b) != cap(b) {
			t.Fatalf("Order %v: body of %d bytes in a buffer of %d", o, len(b), cap(b))
		}
		var got discovery.DeltaDiscoveryResponse
		if err := proto.Unmarshal(b, &got); err != nil {
			t.Fatal(err)
		}
		for i, res := range got.GetResources() {
			if res.GetVersion() != Version(upd[i].Hash, o) {
				t.Fatalf("resource %d: version %s, want %s", i, res.GetVersion(), Version(upd[i].Hash, o))
			}
		}
	}
}

// BenchmarkEncodeDelta encodes a 3,000-cluster Delta body, as a key's
// first sync (or a per-node key's every sync) does.
func BenchmarkEncodeDelta(b *testing.B) {
	t := &testing.T{}
	names := make([]string, 3000)
	for i := range names {
		names[i] = fmt.Sprintf("outbound|8080||svc-%d.ns-%d.svc.cluster.local", i, i%50)
	}
	view, upd := resources(t, names...)
	o := ledger.Order{Session: 1 << 40, At: 3 << 40}
	r := &Response{TypeURL: xds.TypeCluster, Updated: upd, To: view.Root(), View: view.Root(), Order: o, Version: Version(view.Root(), o)}
	b.ReportAllocs()
	for b.Loop() {
		b.SetBytes(int64(len(encodeDelta(r, nil))))
	}
}
