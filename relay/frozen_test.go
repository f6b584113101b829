package relay

import (
	"context"
	"maps"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// The tests of issue 28's first bug: a relay whose upstream stream is up
// but behind (frozen for 10 s, resumed; or fed by an owner that is itself
// behind) must not send a client a view older than what the client
// declares it holds, even content declared without an Order. The chaos
// suite saw Envoys rolled back 70 generations when a frozen owner resumed:
// its view was "live", and a live view covered anything unordered.

// freezer dials the upstream through connections whose reads it can stop:
// while frozen, what the upstream sends queues up unread, and is read in
// a burst once thawed, as by a relay that was SIGSTOPped. The relay's
// stream stays up: nothing tells it that it is behind.
type freezer struct {
	dial func(context.Context, string) (net.Conn, error)

	mu     sync.Mutex
	thawed chan struct{} // closed while not frozen
}

func newFreezer(dial func(context.Context, string) (net.Conn, error)) *freezer {
	f := &freezer{dial: dial, thawed: make(chan struct{})}
	close(f.thawed)
	return f
}

func (f *freezer) freeze() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.thawed = make(chan struct{})
}

func (f *freezer) thaw() {
	f.mu.Lock()
	defer f.mu.Unlock()
	select {
	case <-f.thawed:
	default:
		close(f.thawed)
	}
}

func (f *freezer) gate() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.thawed
}

func (f *freezer) dialer(ctx context.Context, addr string) (net.Conn, error) {
	c, err := f.dial(ctx, addr)
	if err != nil {
		return nil, err
	}
	return frozenConn{Conn: c, f: f}, nil
}

type frozenConn struct {
	net.Conn
	f *freezer
}

// Read hands over what arrived only while thawed: a read under way when
// the freeze began holds what it read until the thaw.
func (c frozenConn) Read(p []byte) (int, error) {
	<-c.f.gate()
	n, err := c.Conn.Read(p)
	<-c.f.gate()
	return n, err
}

// unordered declares d's versions as a relay without Orders would: the
// content hash alone.
func unordered(t *testing.T, d map[string]string) map[string]string {
	t.Helper()
	out := make(map[string]string, len(d))
	for name, v := range d {
		h, _, err := wire.ParseVersion(v)
		if err != nil {
			t.Fatal(err)
		}
		out[name] = wire.Version(h, ledger.Order{})
	}
	return out
}

// TestResumedOwnerSendsNothingOlder: the owner's upstream stream is up but
// reads nothing (a frozen relay's), so its view stays at c0's first
// content while the upstream moves on. A client that holds the newer c0,
// declared without an Order (from a relay whose view had none), connects:
// the owner's view is live, but it is not known to be as new, and the
// client keeps its c0. Once the owner reads again, a stream it opens after
// the declaration answers, and the client gets the rest from it.
func TestResumedOwnerSendsNothingOlder(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	seed(up, "ns1", 3)
	f := newFreezer(up.dialCurrent)
	r := startRelay(t, up, func(c *Config) {
		c.Upstream.DialOptions = append(c.Upstream.DialOptions, grpc.WithContextDialer(f.dialer))
	})
	conn := dial(t, r.Addr().String())
	stays := newRawClient(t, conn, true, node("ns1", "app", 0))
	stays.subscribe(xds.TypeCluster)
	old := stays.recvDelta(xds.TypeCluster)
	stays.ack(old)
	oldC0 := versionMap(old)["c0"]

	f.freeze()
	newer := mkCluster("c0", "newer")
	up.set("ns1", xds.TypeCluster, newer)
	declared := map[string]string{"c0": wire.Version(xds.ContentHash(xds.TypeCluster, mustAny(newer).GetValue()), ledger.Order{})}
	moved := newRawClient(t, conn, true, node("ns1", "app", 1))
	moved.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster, ResourceNamesSubscribe: []string{"*"}, InitialResourceVersions: declared})
	f.thaw()
	m := moved.recvDelta(xds.TypeCluster)
	if v, ok := versionMap(m)["c0"]; ok && v == oldC0 {
		t.Fatalf("the client holding the newer c0 was sent the owner's older c0 (%s)", v)
	}
	if got := removedOf(m); len(got) != 0 {
		t.Fatalf("the client was told %v were removed", got)
	}
	o := orderOf(t, versionOf(m))
	if o.Session <= orderOf(t, oldC0).At {
		t.Fatalf("answered from the stream the owner had when it froze (%v), want one opened after the declaration", o)
	}
	wantNames(t, m, "c1", "c2") // c0 it holds already
}

// TestPeerOfStaleOwnerSendsNothingOlder: the owner's upstream is down, so
// its view is its last one; a relay that subscribes to it gets that view
// from a live stream (the owner's), but a view fed by a stale owner is no
// newer for it, and the relay says it is stale. A client that declares a
// newer c0 without an Order keeps it until a stream opened after its
// declaration answers.
func TestPeerOfStaleOwnerSendsNothingOlder(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	seed(up, "ns1", 3)
	secret := []byte("s")
	owner := startRelay(t, up, func(c *Config) { c.ID = "owner"; c.Tier.Secret = secret })
	peer := startRelay(t, up, func(c *Config) {
		c.ID = "peer"
		c.Tier.Owners = newFakeOwners(owner.Addr().String(), false)
		c.Tier.Secret = secret
	})
	conn := dial(t, peer.Addr().String())
	stays := newRawClient(t, conn, true, node("ns1", "app", 0))
	stays.subscribe(xds.TypeCluster)
	old := stays.recvDelta(xds.TypeCluster)
	stays.ack(old)
	waitFor(t, "the peer fed by the owner", func() bool { return peer.Stats().PeerStreams == 1 })

	up.stop()
	waitFor(t, "the owner's key stale", func() bool { return owner.Stats().StaleKeys == 1 })
	waitFor(t, "the peer's key stale, as its owner's", func() bool { return peer.Stats().StaleKeys == 1 })
	newer := mkCluster("c0", "newer")
	declared := unordered(t, versionMap(old))
	declared["c0"] = wire.Version(xds.ContentHash(xds.TypeCluster, mustAny(newer).GetValue()), ledger.Order{})
	moved := newRawClient(t, conn, true, node("ns1", "app", 1))
	moved.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster, ResourceNamesSubscribe: []string{"*"}, InitialResourceVersions: declared})
	up.set("ns1", xds.TypeCluster, newer)
	up.restart()
	m := moved.recvDelta(xds.TypeCluster)
	if v, ok := versionMap(m)["c0"]; ok && v == versionMap(old)["c0"] {
		t.Fatalf("the client holding the newer c0 was sent the stale owner's older c0 (%s)", v)
	}
	if o := orderOf(t, versionOf(m)); o.Session <= orderOf(t, versionMap(old)["c0"]).At {
		t.Fatalf("answered from the owner's stale view (%v)", o)
	}
	waitFor(t, "the peer's key live again", func() bool { return peer.Stats().StaleKeys == 0 })
}

// savedEndpoints returns a persisted endpoint view of clas, with its true
// root.
func savedEndpoints(t *testing.T, clas ...*endpoint.ClusterLoadAssignment) xds.SavedType {
	t.Helper()
	st := xds.SavedType{Type: xds.TypeEndpoint}
	b := ledger.Tree[struct{}]{}.Edit()
	for _, c := range clas {
		body, err := proto.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		st.Resources = append(st.Resources, xds.SavedResource{Name: c.GetClusterName(), Body: body})
		b.Set(c.GetClusterName(), xds.ContentHash(xds.TypeEndpoint, body), struct{}{})
	}
	st.Root = b.Tree().Root()
	return st
}

// TestPeerViewIsTheOwnersWhileNamesArePending is issue 28's second bug at
// its root. A relay restarted warm holds, from its snapshot, the endpoints
// of a service removed meanwhile ("gone"), which an Envoy that moved to it
// still asks for (its routes use the removed cluster until they are
// updated). The relay asks its owner, which asks the upstream; the
// upstream never answers for a name it lacks, so the name stays pending
// at the owner for ResourceWaitTimeout. The owner never tells its Envoys
// that a pending name does not exist; it used to hold the removal back
// from the relay too, so that every response left the relay's view partly
// its own snapshot's, of unknown age: no Envoy that moved there was sent
// endpoints until the name expired (the Envoy's new clusters stayed
// warming, its routes were held, and after 15 s a route went out to a
// cluster still warming). The relay's view must be the owner's at once,
// ordered, with the name pending at the relay too.
func TestPeerViewIsTheOwnersWhileNamesArePending(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	seed(up, "ns1", 2)
	n := node("ns1", "app", 0)
	key := string(aggkey.Istio{}.Key(n))
	secret := []byte("s")
	owner := startRelay(t, up, func(c *Config) {
		c.ID, c.Tier.Secret = "owner", secret
		c.XDS.ResourceWaitTimeout = time.Hour // the name stays pending throughout
	})
	peer := startRelay(t, up, func(c *Config) {
		c.ID, c.Tier.Secret = "peer", secret
		c.Tier.Owners = newFakeOwners(owner.Addr().String(), false)
		c.XDS.ResourceWaitTimeout = time.Hour
		c.Keys.Snapshots = &savedSnapshots{keys: []xds.SavedKey{{Key: key, Types: []xds.SavedType{
			savedEndpoints(t, mkCLA("c0", 7000), mkCLA("gone", 7000)),
		}}}}
	})
	waitFor(t, "the key restored", func() bool { return peer.Stats().RestoredKeys == 1 })

	c := newRawClient(t, dial(t, peer.Addr().String()), true, n)
	c.subscribe(xds.TypeEndpoint, "c0", "c1", "gone")
	got := map[string]string{}
	for got["c1"] == "" {
		m := c.recvDelta(xds.TypeEndpoint)
		c.ack(m)
		maps.Copy(got, versionMap(m))
	}
	k := peer.cache.heldKeys()[0]
	waitFor(t, "the peer's endpoints the owner's", func() bool {
		ts := k.views.Load().Types[xds.TypeEndpoint]
		_, held := ts.View.Get("gone")
		return !held && !ts.Order.IsZero() && !ts.Order.Mixed
	})
	if ts := k.views.Load().Types[xds.TypeEndpoint]; !ts.IsPending("gone", time.Now(), time.Hour) {
		t.Errorf("the owner's removal of a name pending there made it absent at the peer, not pending")
	}
	// Up to a barrier (responses are ordered), the Envoy is never told
	// that "gone" does not exist: the upstream has not said so.
	c.subscribe(xds.TypeRuntime, "barrier-1")
	for {
		m := c.recv().(*discovery.DeltaDiscoveryResponse)
		if typeOf(m) == xds.TypeRuntime {
			break
		}
		if slices.Contains(m.GetRemovedResources(), "gone") {
			t.Fatalf("the Envoy was told %v do not exist while the upstream was still asked", m.GetRemovedResources())
		}
		c.ack(m)
	}
}

// TestSotWNewStreamDropsWhatItDoesNotSend: a SotW upstream sends, of
// endpoints and routes, only what changed, so the key's view merges its
// answers; and it never says a name asked for by name is gone. A new
// stream's first answer carries every name the stream asked for that the
// upstream has: what else the view holds an earlier stream left, of an
// age the new stream's Order does not bound. Left in, it went out under
// the new Order, to other relays and Envoys that held newer content (the
// chaos suite saw endpoints of a removed service rolled back from
// generation 75 to 1 with a SotW upstream). It goes, pending: clients are
// not told it does not exist.
func TestSotWNewStreamDropsWhatItDoesNotSend(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	seed(up, "ns1", 2)
	up.set("ns1", xds.TypeEndpoint, mkCLA("gone", 7000))
	r := startRelay(t, up, func(c *Config) {
		c.Upstream.Protocol = ProtocolSotW
		c.XDS.ResourceWaitTimeout = time.Hour // pending throughout
	})
	c := newRawClient(t, dial(t, r.Addr().String()), true, node("ns1", "app", 0))
	c.subscribe(xds.TypeEndpoint, "c0", "c1", "gone")
	got := map[string]string{}
	for len(got) < 3 {
		m := c.recvDelta(xds.TypeEndpoint)
		c.ack(m)
		maps.Copy(got, versionMap(m))
	}
	k := r.cache.heldKeys()[0]
	first := k.views.Load().Types[xds.TypeEndpoint].Order

	up.stop()
	up.del("ns1", xds.TypeEndpoint, "gone")
	up.restart()
	waitFor(t, "an answer on a new stream", func() bool {
		return k.views.Load().Types[xds.TypeEndpoint].Order.Session > first.Session
	})
	ts := k.views.Load().Types[xds.TypeEndpoint]
	if _, ok := ts.View.Get("gone"); ok {
		t.Fatalf("the view holds what the new stream did not send, under its Order %v", ts.Order)
	}
	if !ts.IsPending("gone", time.Now(), time.Hour) {
		t.Errorf("what the new stream did not send is absent, not pending")
	}
	c.subscribe(xds.TypeRuntime, "barrier-1")
	for {
		m := c.recv().(*discovery.DeltaDiscoveryResponse)
		if typeOf(m) == xds.TypeRuntime {
			break
		}
		if slices.Contains(m.GetRemovedResources(), "gone") {
			t.Fatalf("the client was told %v do not exist while the upstream was still asked", m.GetRemovedResources())
		}
		c.ack(m)
	}
}

// TestRemovalLeavesAVersionBehind: a Delta client declares what it holds
// resource by resource when it reconnects, so a removal it was told of
// left no trace: the versions it declared were all older than the
// removal, and a relay whose view was on the same stream as they were, but
// older than the removal, covered them and sent the removed resource back
// (the simulation found an endpoint of a removed service back at
// generation 1 after 17). A removal now carries one held resource again,
// whose version is the removal's.
func TestRemovalLeavesAVersionBehind(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	seed(up, "ns1", 3)
	secret := []byte("s")
	owner := startRelay(t, up, func(c *Config) { c.ID, c.Tier.Secret = "owner", secret })
	f := newFreezer(func(ctx context.Context, addr string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", addr)
	})
	peerOf := func(id string, opts ...grpc.DialOption) *Relay {
		return startRelay(t, up, func(c *Config) {
			c.ID, c.Tier.Secret = id, secret
			c.Tier.Owners = newFakeOwners(owner.Addr().String(), false)
			c.Tier.DialOptions = append(c.Tier.DialOptions, opts...)
		})
	}
	live := peerOf("live")
	behind := peerOf("behind", grpc.WithContextDialer(f.dialer))
	w := newRawClient(t, dial(t, behind.Addr().String()), true, node("ns1", "app", 1))
	w.subscribe(xds.TypeCluster)
	w.ack(w.recvDelta(xds.TypeCluster))
	c := newRawClient(t, dial(t, live.Addr().String()), true, node("ns1", "app", 0))
	c.subscribe(xds.TypeCluster)
	first := c.recvDelta(xds.TypeCluster)
	c.ack(first)
	held := versionMap(first)

	f.freeze() // behind's stream to the owner stays up, and reads nothing
	up.del("ns1", xds.TypeCluster, "c2")
	m := c.recvDelta(xds.TypeCluster)
	if !slices.Equal(removedOf(m), []string{"c2"}) {
		t.Fatalf("removed %v, want [c2]", removedOf(m))
	}
	c.ack(m)
	delete(held, "c2")
	maps.Copy(held, versionMap(m)) // the carrier, at the removal's version
	c.close()

	// The scenario: what the client holds came on the stream behind's
	// view came on, and no version it holds is newer than behind's view
	// but the one the removal carried.
	bv := behind.cache.heldKeys()[0].views.Load().Types[xds.TypeCluster]
	if _, ok := bv.View.Get("c2"); !ok {
		t.Fatal("behind's view lost c2: the freeze did not hold, the test checks nothing")
	}
	for n, v := range held {
		if o := orderOf(t, v); !o.SameStream(bv.Order) {
			t.Fatalf("%s held at %v, behind's view at %v: not one stream, the test checks nothing", n, o, bv.Order)
		}
	}
	moved := newRawClient(t, dial(t, behind.Addr().String()), true, node("ns1", "app", 0))
	moved.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster, ResourceNamesSubscribe: []string{"*"}, InitialResourceVersions: held})
	// An answer from the view behind the removal comes at once; a relay
	// that waits for a view that covers what the client holds answers
	// once behind reads again. (Under load the wrong answer may come
	// after the thaw, from a view without c2: the test then passes
	// without having checked; it never fails a right relay.)
	go func() {
		time.Sleep(300 * time.Millisecond)
		f.thaw()
	}()
	got := moved.recvDelta(xds.TypeCluster)
	if slices.Contains(names(got), "c2") {
		t.Fatalf("the client told c2 was removed got it back from a view older than the removal: %v", names(got))
	}
}
