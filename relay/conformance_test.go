package relay

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	meshv1alpha1 "istio.io/api/mesh/v1alpha1"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
	"github.com/meshrelay/meshrelay/relay/xds/ndspb"
)

// env is one conformance case's world: a real go-control-plane upstream
// seeded with three services in namespace ns1, and a relay in front of it.
type env struct {
	t     *testing.T
	delta bool
	up    *testUpstream
	r     *Relay
	conn  *grpc.ClientConn
	// wall is the wall clock of the relay's version stamps.
	wall *testWall
}

func newEnv(t *testing.T, delta bool, mod func(*Config)) *env {
	up := newTestUpstream(t, "ns1", "ns2")
	seed(up, "ns1", 3)
	seed(up, "ns2", 3)
	up.set("ns1", typeOther, &structpb.Struct{Fields: map[string]*structpb.Value{"host": structpb.NewStringValue("c0.ns1")}})
	wall := newTestWall()
	r := startRelay(t, up, func(c *Config) {
		c.wall = wall.now
		if mod != nil {
			mod(c)
		}
	})
	return &env{t: t, delta: delta, up: up, r: r, conn: dial(t, r.Addr().String()), wall: wall}
}

// testWall is the wall clock, which a test may move ahead (a relay whose
// clock is ahead of the others'). It runs: a relay opens a stream after
// content arrived only in a later millisecond (ledger.Stamp.Before), and
// one whose clock stood still would never open one.
type testWall struct{ ahead atomic.Int64 }

func newTestWall() *testWall { return &testWall{} }

func (w *testWall) now() time.Time          { return time.Now().Add(time.Duration(w.ahead.Load())) }
func (w *testWall) advance(d time.Duration) { w.ahead.Add(int64(d)) }
func (w *testWall) orderIn(d time.Duration) ledger.Order {
	s := ledger.StampAt(w.now().Add(d))
	return ledger.Order{Session: s, At: s}
}

func (e *env) client(i int) *rawClient {
	return newRawClient(e.t, e.conn, e.delta, node("ns1", "app", i))
}

// syncAll subscribes c to CDS (wildcard), EDS for every cluster, LDS
// (wildcard) and RDS r80, as Envoy would, ACKing everything.
func syncAll(c *rawClient) map[string]proto.Message {
	c.t.Helper()
	got := map[string]proto.Message{}
	step := func(typeURL string, names ...string) {
		c.subscribe(typeURL, names...)
		m := c.recv()
		if typeOf(m) != typeURL {
			c.t.Fatalf("got %s, want %s", xds.ShortType(typeOf(m)), xds.ShortType(typeURL))
		}
		c.ack(m)
		got[typeURL] = m
	}
	step(xds.TypeCluster)
	step(xds.TypeEndpoint, "c0", "c1", "c2")
	step(xds.TypeListener)
	step(xds.TypeRoute, "r80")
	return got
}

func sorted(s []string) []string { return slices.Sorted(slices.Values(s)) }

func wantNames(t *testing.T, m proto.Message, want ...string) {
	t.Helper()
	if got := sorted(names(m)); !slices.Equal(got, sorted(want)) {
		t.Fatalf("%s resources = %v, want %v", xds.ShortType(typeOf(m)), got, sorted(want))
	}
}

func removedOf(m proto.Message) []string {
	if d, ok := m.(*discovery.DeltaDiscoveryResponse); ok {
		return sorted(d.GetRemovedResources())
	}
	return nil
}

// status returns the relay's view of a client's state for a type.
// waitAcked waits up to 5 s for the relay to have taken the client's ACK of
// version.
func (e *env) waitAcked(t *testing.T, nodeID, typeURL, version string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if e.status(nodeID, typeURL).AckedVersion == version {
			return
		}
	}
	t.Fatalf("the relay never took the ACK of %s", version)
}

func versionOf(m proto.Message) string {
	switch r := m.(type) {
	case *discovery.DiscoveryResponse:
		return r.GetVersionInfo()
	case *discovery.DeltaDiscoveryResponse:
		return r.GetSystemVersionInfo()
	}
	return ""
}

// waitLedger waits up to 5 s for the relay's ledger to count want, with the
// one straggler's reason (if any).
func (e *env) waitLedger(t *testing.T, when string, want ledger.Convergence, reason ledger.Reason) {
	t.Helper()
	var got ledger.Convergence
	var ss []ledger.Straggler
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		sum := e.r.Ledger().Summary(ledger.Scope{}, time.Now(), ledger.Brief)
		got, ss = sum.Convergence(), sum.Stragglers(0)
		if got == want && (reason == "" && len(ss) == 0 || len(ss) == 1 && ss[0].Reason == reason) {
			return
		}
	}
	t.Fatalf("after %s: ledger %+v with stragglers %+v; want %+v, reason %q", when, got, ss, want, reason)
}

func (e *env) status(nodeID, typeURL string) TypeStatus {
	for _, c := range e.r.Clients() {
		if c.NodeID == nodeID {
			return c.Types[typeURL]
		}
	}
	e.t.Fatalf("no client %s on the relay", nodeID)
	return TypeStatus{}
}

// TestConformance is the protocol conformance table: every rule the relay
// owes its clients, once over SotW and once over Delta, against a real
// go-control-plane upstream.
func TestConformance(t *testing.T) {
	cases := []struct {
		name string
		run  func(t *testing.T, e *env)
	}{
		{"wildcard and named subscriptions, changed mid-stream", func(t *testing.T, e *env) {
			c := e.client(0)
			c.subscribe(xds.TypeCluster)
			m := c.recv()
			wantNames(t, m, "c0", "c1", "c2")
			c.ack(m)
			c.subscribe(xds.TypeEndpoint, "c0")
			m = c.recv()
			wantNames(t, m, "c0")
			c.ack(m)
			c.subscribe(xds.TypeEndpoint, "c0", "c1") // Delta: subscribes c0 again, so it is re-sent
			m = c.recv()
			if e.delta {
				wantNames(t, m, "c0", "c1")
			} else {
				wantNames(t, m, "c1") // SotW EDS: only what the client lacks
			}
			c.ack(m)
			// Unsubscribe c0: its changes no longer reach the client.
			if e.delta {
				c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResourceNamesUnsubscribe: []string{"c0"}})
			} else {
				c.subscribe(xds.TypeEndpoint, "c1")
			}
			c.quiet() // the relay has read the unsubscription
			e.up.set("ns1", xds.TypeEndpoint, mkCLA("c0", 9090))
			c.quiet()
			e.up.set("ns1", xds.TypeEndpoint, mkCLA("c1", 9090))
			m = c.recv()
			wantNames(t, m, "c1")
		}},
		{"unsubscribe then subscribe again is re-sent (go-control-plane #431, #608)", func(t *testing.T, e *env) {
			c := e.client(0)
			c.subscribe(xds.TypeEndpoint, "c0", "c1")
			c.ack(c.recv())
			if e.delta {
				c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResourceNamesUnsubscribe: []string{"c1"}})
			} else {
				c.subscribe(xds.TypeEndpoint, "c0")
			}
			c.quiet()
			c.subscribe(xds.TypeEndpoint, "c0", "c1")
			if e.delta {
				// Both named again; c1 comes once the relay has it again.
				c.recvAll(xds.TypeEndpoint, "c0", "c1")
			} else {
				wantNames(t, c.recv(), "c1")
			}
		}},
		{"cluster removed and re-added gets its endpoints again (go-control-plane #583)", func(t *testing.T, e *env) {
			c := e.client(0)
			syncAll(c)
			e.up.set("ns1", xds.TypeRoute, mkRoute("r80", "c0", "c1"))
			c.ack(c.recv()) // RDS without c2
			e.up.del("ns1", xds.TypeCluster, "c2")
			m := c.recv()
			if e.delta {
				if got := removedOf(m); !slices.Equal(got, []string{"c2"}) {
					t.Fatalf("CDS removed = %v, want [c2]", got)
				}
			} else {
				wantNames(t, m, "c0", "c1")
			}
			c.ack(m)
			if e.delta {
				c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResourceNamesUnsubscribe: []string{"c2"}})
			} else {
				c.subscribe(xds.TypeEndpoint, "c0", "c1")
			}
			c.quiet()
			e.up.set("ns1", xds.TypeCluster, mkCluster("c2"))
			m = c.recv()
			if e.delta {
				wantNames(t, m, "c2")
			} else {
				wantNames(t, m, "c0", "c1", "c2")
			}
			c.ack(m)
			c.subscribe(xds.TypeEndpoint, "c0", "c1", "c2")
			if e.delta {
				c.recvAll(xds.TypeEndpoint, "c0", "c1", "c2") // all named again
			} else {
				c.recvAll(xds.TypeEndpoint, "c2")
			}
		}},
		{"updated cluster gets its endpoints again, after it", func(t *testing.T, e *env) {
			c := e.client(0)
			syncAll(c)
			e.up.set("ns1", xds.TypeCluster, mkCluster("c1", "changed"))
			m := c.recv()
			if e.delta {
				wantNames(t, m, "c1")
			} else {
				wantNames(t, m, "c0", "c1", "c2")
			}
			c.ack(m)
			m = c.recvSotWOrDelta(xds.TypeEndpoint)
			wantNames(t, m, "c1")
		}},
		{"stale nonce", func(t *testing.T, e *env) {
			c := e.client(0)
			c.subscribe(xds.TypeEndpoint, "c0")
			m := c.recv()
			c.ack(m)
			if e.delta {
				// Delta: subscription changes count whatever the nonce.
				c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResponseNonce: "no-such-nonce", ResourceNamesSubscribe: []string{"c2"}})
				wantNames(t, c.recv(), "c2")
				return
			}
			// SotW: a request with a stale nonce is not answered.
			c.send(&discovery.DiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResourceNames: []string{"c0", "c2"}, ResponseNonce: "no-such-nonce"})
			c.quiet()
		}},
		{"nonces unique and control plane named", func(t *testing.T, e *env) {
			c := e.client(0)
			for _, m := range syncAll(c) { // rawClient.recv checks uniqueness
				var id string
				switch r := m.(type) {
				case *discovery.DiscoveryResponse:
					id = r.GetControlPlane().GetIdentifier()
				case *discovery.DeltaDiscoveryResponse:
					id = r.GetControlPlane().GetIdentifier()
				}
				if id != "relay-test" {
					t.Fatalf("control_plane.identifier = %q, want relay-test", id)
				}
			}
		}},
		{"NACK recorded, parked until content changes, never forwarded", func(t *testing.T, e *env) {
			c := e.client(0)
			c.subscribe(xds.TypeCluster)
			m := c.recv()
			c.nack(m, "")
			c.quiet() // not re-sent
			st := e.status(c.node.GetId(), xds.TypeCluster)
			if st.NACK == nil || st.NACK.Detail != "rejected by test" {
				t.Fatalf("status NACK = %+v, want the test's rejection", st.NACK)
			}
			if n := e.up.nacksSeen(); n != 0 {
				t.Fatalf("upstream saw %d NACKs, want 0: a client's NACK must not reach the shared stream", n)
			}
			e.up.set("ns1", xds.TypeCluster, mkCluster("c0", "fixed"))
			m = c.recv()
			if e.delta {
				wantNames(t, m, "c0")
			} else {
				wantNames(t, m, "c0", "c1", "c2")
			}
			c.ack(m)
			c.quiet()
			if st := e.status(c.node.GetId(), xds.TypeCluster); st.NACK != nil || st.AckedVersion == "" {
				t.Fatalf("status after ACK = %+v, want ACKed and no NACK", st)
			}
		}},
		{"ledger: a NACKed change keeps the client behind until it is sent again", func(t *testing.T, e *env) {
			c := e.client(0)
			c.subscribe(xds.TypeCluster)
			c.ack(c.recv())
			e.waitLedger(t, "the first ACK", ledger.Convergence{Envoys: 1, Current: 1}, "")
			e.up.set("ns1", xds.TypeCluster, mkCluster("c0", "v2"))
			c.nack(c.recv(), "")
			e.waitLedger(t, "the NACK", ledger.Convergence{Envoys: 1}, ledger.NACKed)
			// A response that carries other names only: an ACK of it does
			// not mean the client holds c0 at v2. (A SotW CDS response
			// carries everything, c0 included: the ACK clears the NACK.)
			e.up.set("ns1", xds.TypeCluster, mkCluster("c3"))
			m := c.recv()
			c.ack(m)
			e.waitAcked(t, c.node.GetId(), xds.TypeCluster, versionOf(m))
			if !e.delta {
				e.waitLedger(t, "a SotW full-state ACK", ledger.Convergence{Envoys: 1, Current: 1}, "")
				return
			}
			e.waitLedger(t, "an ACK of another name", ledger.Convergence{Envoys: 1}, ledger.NACKed)
			e.up.set("ns1", xds.TypeCluster, mkCluster("c0", "v3"))
			c.ack(c.recv())
			e.waitLedger(t, "c0 sent again and ACKed", ledger.Convergence{Envoys: 1, Current: 1}, "")
		}},
		{"node from the first request is kept", func(t *testing.T, e *env) {
			c := e.client(0)
			c.subscribe(xds.TypeCluster)
			c.ack(c.recv())
			// A later request naming another namespace's node changes nothing.
			if e.delta {
				c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResourceNamesSubscribe: []string{"c0"}, Node: node("ns2", "other", 9)})
			} else {
				c.send(&discovery.DiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResourceNames: []string{"c0"}, Node: node("ns2", "other", 9)})
			}
			c.ack(c.recv())
			clients := e.r.Clients()
			if len(clients) != 1 || clients[0].NodeID != c.node.GetId() || !strings.Contains(string(clients[0].Key), "/ns1/") {
				t.Fatalf("clients = %+v, want one on ns1 with the first node", clients)
			}
		}},
		{"content versions: same content, same version on another relay", func(t *testing.T, e *env) {
			// Two relays that each hold their own upstream stream stamp
			// what they receive each with its own clock: the content part
			// of their versions is the same.
			r2 := startRelay(t, e.up, func(c *Config) { c.ID = "relay-2" })
			c1 := e.client(0)
			c2 := newRawClient(t, dial(t, r2.Addr().String()), e.delta, node("ns1", "app", 1))
			a, b := syncAll(c1), syncAll(c2)
			for _, typeURL := range []string{xds.TypeCluster, xds.TypeEndpoint, xds.TypeListener, xds.TypeRoute} {
				va, vb := contentVersions(t, versionsOf(a[typeURL])), contentVersions(t, versionsOf(b[typeURL]))
				if !slices.Equal(va, vb) || len(va) == 0 {
					t.Fatalf("%s versions differ between relays: %v vs %v", xds.ShortType(typeURL), va, vb)
				}
			}
		}},
		{"reconnect holding current content gets nothing again", func(t *testing.T, e *env) {
			c := e.client(0)
			got := syncAll(c)
			c.close()
			c2 := e.client(0)
			if e.delta {
				for _, typeURL := range []string{xds.TypeCluster, xds.TypeEndpoint} {
					d := got[typeURL].(*discovery.DeltaDiscoveryResponse)
					c2.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesSubscribe: subscriptionOf(typeURL), InitialResourceVersions: versionMap(d)})
				}
				m := c2.recv() // a wildcard subscription is always answered, here empty
				if typeOf(m) != xds.TypeCluster || len(names(m)) != 0 || len(removedOf(m)) != 0 {
					t.Fatalf("CDS after reconnect: %v removed %v, want an empty answer", names(m), removedOf(m))
				}
				c2.ack(m)
			} else {
				for _, typeURL := range []string{xds.TypeCluster, xds.TypeEndpoint} {
					s := got[typeURL].(*discovery.DiscoveryResponse)
					c2.send(&discovery.DiscoveryRequest{TypeUrl: typeURL, ResourceNames: subscriptionOf(typeURL), VersionInfo: s.GetVersionInfo()})
					c2.subs[typeURL] = subscriptionOf(typeURL)
				}
			}
			c2.quiet()
		}},
		{"reconnect: what was removed meanwhile is removed (istio #41494)", func(t *testing.T, e *env) {
			c := e.client(0)
			got := syncAll(c)
			c.close()
			e.up.set("ns1", xds.TypeRoute, mkRoute("r80", "c0", "c1"))
			e.up.del("ns1", xds.TypeCluster, "c2")
			// A second client keeps the key alive and sees the change land.
			w := e.client(5)
			syncAllExpect(w, "c0", "c1")
			c2 := e.client(0)
			if e.delta {
				d := got[xds.TypeCluster].(*discovery.DeltaDiscoveryResponse)
				c2.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster, InitialResourceVersions: versionMap(d)})
				m := c2.recv()
				if len(removedOf(m)) == 0 && len(names(m)) == 0 {
					// "You are current", with the removal held until the
					// client had a chance to declare the routes that may
					// still use c2 (awaitingDeclarations); it never did.
					c2.ack(m)
					m = c2.recv()
				}
				if r := removedOf(m); !slices.Equal(r, []string{"c2"}) || len(names(m)) > 1 {
					t.Fatalf("CDS after reconnect: resources %v removed %v, want removed [c2] only (and one held resource again, its version the removal's)", names(m), r)
				}
			} else {
				s := got[xds.TypeCluster].(*discovery.DiscoveryResponse)
				c2.send(&discovery.DiscoveryRequest{TypeUrl: xds.TypeCluster, VersionInfo: s.GetVersionInfo()})
				m := c2.recv()
				if slices.Contains(names(m), "c2") {
					// c2 still held until the client answered without
					// declaring the routes that may use it
					// (awaitingDeclarations).
					c2.ack(m)
					m = c2.recv()
				}
				wantNames(t, m, "c0", "c1")
			}
		}},
		// A client that moved from another relay declares what it holds,
		// stamped with the order of the version it came from; the view
		// wins exactly when it is at least as new. The Delta cases failed
		// on the time-bound holds they replace (content this relay never
		// saw was held 5 s whatever its age, and what the client lacked
		// was sent at once, even when the client was ahead); on SotW the
		// first case was a delay only, which no order of messages shows.
		{"moved: content older than the view is replaced at once", func(t *testing.T, e *env) {
			// It holds content this relay never had, from a version
			// ordered before the view (and, in Delta, lacks c2).
			c, claim := e.moved(t, "older", olderThan)
			if e.delta {
				wantNames(t, c.recv(), "c0", "c2")
				return
			}
			m := c.recv()
			wantNames(t, m, "c0", "c1")
			if v := versionOf(m); v == claim {
				t.Fatalf("answered with the claimed version %s, want the view's", v)
			}
		}},
		{"moved: content newer than the view is kept until the view is newer", func(t *testing.T, e *env) {
			// It holds content of a later version than the view (from
			// a relay further on), in which, in Delta, c2 is gone.
			c, ahead := e.moved(t, "newer", func(ledger.Order) ledger.Order { return e.wall.orderIn(time.Second) })
			c.quiet() // neither c0 overwritten nor c2 brought back
			// Time passes; the relay renews its upstream stream (the
			// client holds a version from a stream opened after its own)
			// and the upstream moves on: the view covers what the client
			// holds, and wins.
			e.wall.advance(2 * time.Second)
			if e.delta {
				e.up.set("ns1", xds.TypeCluster, mkCluster("c1", "v2"))
				m := c.recv()
				wantNames(t, m, "c0", "c1", "c2")
				if v := orderOf(t, versionMap(m.(*discovery.DeltaDiscoveryResponse))["c1"]); !v.Covers(orderOf(t, ahead)) {
					t.Fatalf("sent at order %v, which does not cover the client's %v", v, orderOf(t, ahead))
				}
				return
			}
			e.up.set("ns1", xds.TypeEndpoint, mkCLA("c0", 9090))
			m := c.recv()
			wantNames(t, m, "c0", "c1")
			if v := orderOf(t, versionOf(m)); !v.Covers(orderOf(t, ahead)) {
				t.Fatalf("sent at order %v, which does not cover the client's %v", v, orderOf(t, ahead))
			}
		}},
		{"moved: the view's content under a newer stamp is not sent again", func(t *testing.T, e *env) {
			c := e.client(0)
			got := syncAll(c)
			c.close()
			c2 := e.client(0)
			later := func(v string) string {
				h, o, err := wire.ParseVersion(v)
				if err != nil {
					t.Fatal(err)
				}
				o.At++ // later on the same stream
				return wire.Version(h, o)
			}
			for _, typeURL := range []string{xds.TypeCluster, xds.TypeEndpoint} {
				if e.delta {
					declared := versionMap(got[typeURL].(*discovery.DeltaDiscoveryResponse))
					for n, v := range declared {
						declared[n] = later(v)
					}
					c2.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesSubscribe: subscriptionOf(typeURL), InitialResourceVersions: declared})
					continue
				}
				c2.send(&discovery.DiscoveryRequest{TypeUrl: typeURL, ResourceNames: subscriptionOf(typeURL), VersionInfo: later(versionOf(got[typeURL]))})
				c2.subs[typeURL] = subscriptionOf(typeURL)
			}
			if e.delta {
				m := c2.recv() // a wildcard subscription is always answered, here empty
				if typeOf(m) != xds.TypeCluster || len(names(m)) != 0 || len(removedOf(m)) != 0 {
					t.Fatalf("CDS after reconnect: %v removed %v, want an empty answer", names(m), removedOf(m))
				}
				c2.ack(m)
			}
			c2.quiet()
		}},
		{"named again is sent even if declared (Envoy #22418)", func(t *testing.T, e *env) {
			if !e.delta {
				t.Skip("Delta only: SotW clients declare no per-resource versions")
			}
			c := e.client(0)
			c.subscribe(xds.TypeEndpoint, "c0", "c1")
			d := c.recv().(*discovery.DeltaDiscoveryResponse)
			c.ack(d)
			c.close()
			c2 := e.client(0)
			c2.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResourceNamesSubscribe: []string{"c0", "c1"}, InitialResourceVersions: versionMap(d)})
			c2.quiet()                           // declared and current: nothing
			c2.subscribe(xds.TypeEndpoint, "c1") // the client forgot c1 and asks again
			wantNames(t, c2.recv(), "c1")
		}},
		{"NDS and PCDS are aggregated: one upstream stream for a key's agents, one resource", func(t *testing.T, e *env) {
			// Each type with what a response's one resource says, and a
			// change istiod may make to it.
			singletons := []struct {
				typeURL string
				read    func(*testing.T, proto.Message) []string
				want    []string
				change  types.Resource
			}{
				{xds.TypeNameTable, nameTableHosts, []string{"c0.ns1.svc.cluster.local", "c1.ns1.svc.cluster.local", "c2.ns1.svc.cluster.local"}, nameTable("ns1", 4)},
				{xds.TypeProxyConfig, trustBundle, []string{"root of ns1"}, &meshv1alpha1.ProxyConfig{CaCertificatesPem: []string{"root of ns1", "new root"}}},
			}
			_, before := e.up.streams()
			var clients []*rawClient
			for i := range 3 {
				c := e.client(20 + i)
				c.subscribe(xds.TypeCluster)
				c.ack(c.recv())
				for _, st := range singletons {
					c.subscribe(st.typeURL) // as pilot-agent: no names
					m := c.recv()
					if typeOf(m) != st.typeURL {
						t.Fatalf("client %d: got %s, want its %s", i, xds.ShortType(typeOf(m)), xds.ShortType(st.typeURL))
					}
					if got := st.read(t, m); !slices.Equal(got, st.want) {
						t.Fatalf("client %d: %s says %q, want %q", i, xds.ShortType(st.typeURL), got, st.want)
					}
					c.ack(m)
				}
				clients = append(clients, c)
			}
			if _, after := e.up.streams(); after-before != 1 {
				t.Fatalf("upstream streams opened = %d, want 1: the key's, NDS and PCDS on it", after-before)
			}
			// istiod rebuilds each: every agent gets the new one.
			for _, st := range singletons {
				e.up.set("ns1", st.typeURL, st.change)
				for i, c := range clients {
					m := c.recv()
					if got := st.read(t, m); len(got) != len(st.want)+1 {
						t.Fatalf("client %d after the change: %s says %q, want one more than %q", i, xds.ShortType(st.typeURL), got, st.want)
					}
					c.ack(m)
				}
			}
		}},
		{"a type the upstream never answers (PCDS without MULTI_ROOT_MESH) leaves the rest confirmed", func(t *testing.T, e *env) {
			e.up.silence(xds.TypeProxyConfig)
			c := e.client(0)
			c.subscribe(xds.TypeProxyConfig) // pilot-agent asks before Envoy does
			c.subscribe(xds.TypeCluster)
			m := c.recv()
			if typeOf(m) != xds.TypeCluster {
				t.Fatalf("got %s, want the clusters (the upstream says nothing of PCDS)", xds.ShortType(typeOf(m)))
			}
			c.ack(m)
			// The upstream restarts: until the new stream answers, the
			// key's views are stale; its answers confirm them, the
			// silent type's missing answer notwithstanding (a Delta
			// upstream is otherwise waited for on every type).
			_, opened := e.up.streams()
			e.up.stop()
			e.up.restart()
			waitFor(t, "the key's new upstream stream", func() bool { _, n := e.up.streams(); return n > opened })
			waitFor(t, "the key's views confirmed by the new stream", func() bool { st := e.r.Stats(); return st.Keys == 1 && st.StaleKeys == 0 })
			c.quiet() // and nothing is made up for PCDS
		}},
		{"unknown types pass through, per stream", func(t *testing.T, e *env) {
			_, before := e.up.streams()
			for i := range 2 {
				c := e.client(10 + i)
				c.subscribe(xds.TypeCluster)
				c.ack(c.recv())
				c.subscribe(typeOther)
				m := c.recv()
				if typeOf(m) != typeOther || len(resourcesOf(m)) != 1 {
					t.Fatalf("client %d: got %s with %d resources, want one resource", i, xds.ShortType(typeOf(m)), len(resourcesOf(m)))
				}
				c.ack(m)
				c.quiet()
			}
			_, after := e.up.streams()
			// One aggregated stream for the key, one passthrough stream each.
			if got := after - before; got != 3 {
				t.Fatalf("upstream streams opened = %d, want 3 (1 shared + 2 passthrough)", got)
			}
		}},
		{"removals last: a cluster goes only after no route refers to it", func(t *testing.T, e *env) {
			c := e.client(0)
			syncAll(c)
			// The upstream removes the cluster first, the route later.
			e.up.del("ns1", xds.TypeCluster, "c2")
			c.quiet() // held: route r80 still routes to c2
			e.up.set("ns1", xds.TypeRoute, mkRoute("r80", "c0", "c1"))
			m := c.recv()
			if typeOf(m) != xds.TypeRoute {
				t.Fatalf("got %s first, want the route update before the cluster removal", xds.ShortType(typeOf(m)))
			}
			c.ack(m)
			m = c.recv()
			if typeOf(m) != xds.TypeCluster {
				t.Fatalf("got %s, want the held cluster removal", xds.ShortType(typeOf(m)))
			}
			if e.delta {
				if r := removedOf(m); !slices.Equal(r, []string{"c2"}) {
					t.Fatalf("removed = %v, want [c2]", r)
				}
			} else {
				wantNames(t, m, "c0", "c1")
			}
		}},
		{"a route to a new cluster waits for the cluster's endpoints (Envoy warms it until they arrive)", func(t *testing.T, e *env) {
			c := e.client(0)
			syncAll(c)
			// The upstream sends the route first, then the cluster, then
			// its endpoints.
			e.up.set("ns1", xds.TypeRoute, mkRoute("r80", "c0", "c1", "c2", "c3"))
			e.up.set("ns1", xds.TypeCluster, mkCluster("c3"))
			e.up.set("ns1", xds.TypeEndpoint, mkCLA("c3", 9093))
			m := c.recv()
			if typeOf(m) != xds.TypeCluster {
				t.Fatalf("got %s first, want the new cluster", xds.ShortType(typeOf(m)))
			}
			c.ack(m)
			// The client holds c3, warming: a route to it now would fail.
			c.quiet()
			c.subscribe(xds.TypeEndpoint, "c0", "c1", "c2", "c3")
			m = c.recv()
			if typeOf(m) != xds.TypeEndpoint || !slices.Contains(names(m), "c3") {
				t.Fatalf("got %s %v, want c3's endpoints before the route", xds.ShortType(typeOf(m)), names(m))
			}
			c.ack(m)
			m = c.recv()
			if typeOf(m) != xds.TypeRoute {
				t.Fatalf("got %s, want the route once c3 is warm", xds.ShortType(typeOf(m)))
			}
		}},
		{"authorizer refuses before anything is served", func(t *testing.T, e *env) {
			r := startRelay(t, e.up, func(c *Config) { c.XDS.Authorizer = denyNamespace("ns1") })
			c := newRawClient(t, dial(t, r.Addr().String()), e.delta, node("ns1", "app", 0))
			c.subscribe(xds.TypeCluster)
			if err := c.streamErr(); status.Code(err) != codes.PermissionDenied {
				t.Fatalf("stream error = %v, want PermissionDenied", err)
			}
		}},
		{"responses beyond gRPC's 4 MiB default", func(t *testing.T, e *env) {
			big := strings.Repeat("x", 4096)
			var cs []types.Resource
			for i := range 1500 { // ≈ 6 MB of CDS
				c := mkCluster(fmt.Sprint("big-", i))
				c.Metadata = &core.Metadata{FilterMetadata: map[string]*structpb.Struct{"pad": {Fields: map[string]*structpb.Value{"v": structpb.NewStringValue(big)}}}}
				cs = append(cs, c)
			}
			e.up.set("ns2", xds.TypeCluster, cs...)
			c := newRawClient(t, e.conn, e.delta, node("ns2", "app", 0))
			c.subscribe(xds.TypeCluster)
			m := c.recv()
			if n := len(names(m)); n != 1503 {
				t.Fatalf("CDS resources = %d, want 1503", n)
			}
			if size := proto.Size(m); size < 6_000_000 {
				t.Fatalf("response size = %d, want > 6 MB", size)
			}
		}},
	}
	for _, tc := range cases {
		for _, delta := range []bool{false, true} {
			t.Run(protocolName(delta)+"/"+tc.name, func(t *testing.T) {
				tc.run(t, newEnv(t, delta, nil))
			})
		}
	}
}

// recvAll receives responses of typeURL until every name in want has come,
// failing on any other name or type.
func (c *rawClient) recvAll(typeURL string, want ...string) {
	c.t.Helper()
	missing := map[string]bool{}
	for _, n := range want {
		missing[n] = true
	}
	for len(missing) > 0 {
		m := c.recvSotWOrDelta(typeURL)
		for _, n := range names(m) {
			if !slices.Contains(want, n) {
				c.t.Fatalf("got %s %s, want only %v", xds.ShortType(typeURL), n, want)
			}
			delete(missing, n)
		}
		c.ack(m)
	}
}

// recvSotWOrDelta receives the next response and checks its type.
func (c *rawClient) recvSotWOrDelta(typeURL string) proto.Message {
	c.t.Helper()
	m := c.recv()
	if typeOf(m) != typeURL {
		c.t.Fatalf("got %s, want %s", xds.ShortType(typeOf(m)), xds.ShortType(typeURL))
	}
	return m
}

// syncAllExpect subscribes to CDS and waits until the client holds exactly
// clusters (updates may still be on their way to the relay).
func syncAllExpect(c *rawClient, clusters ...string) {
	c.t.Helper()
	c.subscribe(xds.TypeCluster)
	held := map[string]bool{}
	for range 10 {
		m := c.recv()
		c.ack(m)
		if _, sotw := m.(*discovery.DiscoveryResponse); sotw {
			clear(held)
		}
		for _, n := range names(m) {
			held[n] = true
		}
		for _, n := range removedOf(m) {
			delete(held, n)
		}
		if got := sorted(slices.Collect(maps.Keys(held))); slices.Equal(got, sorted(clusters)) {
			return
		}
	}
	c.t.Fatalf("client never held exactly %v", clusters)
}

func subscriptionOf(typeURL string) []string {
	if typeURL == xds.TypeEndpoint {
		return []string{"c0", "c1", "c2"}
	}
	return nil
}

func resourcesOf(m proto.Message) []string {
	switch r := m.(type) {
	case *discovery.DiscoveryResponse:
		out := make([]string, len(r.GetResources()))
		for i, a := range r.GetResources() {
			out[i] = string(a.GetValue())
		}
		return out
	case *discovery.DeltaDiscoveryResponse:
		out := make([]string, len(r.GetResources()))
		for i, x := range r.GetResources() {
			out[i] = x.GetVersion()
		}
		return out
	}
	return nil
}

// versionsOf returns SotW's version_info, or Delta's resource versions.
// contentVersions strips the stamps off versions ("name=version" or bare).
func contentVersions(t *testing.T, vs []string) []string {
	t.Helper()
	out := make([]string, len(vs))
	for i, v := range vs {
		prefix, version := "", v
		if n, rest, ok := strings.Cut(v, "="); ok {
			prefix, version = n+"=", rest
		}
		h, _, err := wire.ParseVersion(version)
		if err != nil {
			t.Fatalf("version %q: %v", v, err)
		}
		out[i] = prefix + h.String()
	}
	return out
}

func versionsOf(m proto.Message) []string {
	switch r := m.(type) {
	case *discovery.DiscoveryResponse:
		return []string{r.GetVersionInfo()}
	case *discovery.DeltaDiscoveryResponse:
		var out []string
		for _, x := range r.GetResources() {
			out = append(out, x.GetName()+"="+x.GetVersion())
		}
		return sorted(out)
	}
	return nil
}

// moved plays a client that held the relay's config and moves back to it
// holding other content at an Order of its own (order, from the Order of
// what it was sent). In Delta it holds CDS with c0 at that content and
// without c2; in SotW it claims that version of EDS for c0 and c1. It
// returns the new client and the version it declared.
func (e *env) moved(t *testing.T, content string, order func(ledger.Order) ledger.Order) (*rawClient, string) {
	t.Helper()
	c := e.client(0)
	if e.delta {
		c.subscribe(xds.TypeCluster)
		d := c.recv().(*discovery.DeltaDiscoveryResponse)
		c.ack(d)
		c.close()
		declared := versionMap(d)
		declared["c0"] = wire.Version(ledger.HashBytes([]byte(content)), order(orderOf(t, declared["c0"])))
		delete(declared, "c2")
		c = e.client(0)
		c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster, InitialResourceVersions: declared})
		return c, declared["c0"]
	}
	c.subscribe(xds.TypeEndpoint, "c0", "c1")
	m := c.recv()
	c.ack(m)
	c.close()
	claim := wire.Version(ledger.HashBytes([]byte(content)), order(orderOf(t, versionOf(m))))
	c = e.client(0)
	c.send(&discovery.DiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResourceNames: []string{"c0", "c1"}, VersionInfo: claim})
	c.subs[xds.TypeEndpoint] = []string{"c0", "c1"}
	return c, claim
}

// orderOf returns the Order of a wire version.
func orderOf(t *testing.T, v string) ledger.Order {
	t.Helper()
	_, o, err := wire.ParseVersion(v)
	if err != nil || o.IsZero() {
		t.Fatalf("version %q has no order (%v)", v, err)
	}
	return o
}

// olderThan returns an Order that o covers: of a stream closed before o's
// was opened.
func olderThan(o ledger.Order) ledger.Order {
	return ledger.Order{Session: o.Session - 1, At: o.Session - 1}
}

func versionMap(d *discovery.DeltaDiscoveryResponse) map[string]string {
	out := map[string]string{}
	for _, x := range d.GetResources() {
		out[x.GetName()] = x.GetVersion()
	}
	return out
}

type denyNamespace string

func (d denyNamespace) Authorize(_ context.Context, n *core.Node) error {
	if strings.Contains(n.GetId(), "."+string(d)+"~") {
		return errors.New("namespace not allowed")
	}
	return nil
}

// nameTable is what istiod's NDS gives a sidecar of ns that sees n
// services: each service's host and address.
func nameTable(ns string, n int) *ndspb.NameTable {
	nt := &ndspb.NameTable{Table: map[string]*ndspb.NameTable_NameInfo{}}
	for i := range n {
		nt.Table[fmt.Sprintf("c%d.%s.svc.cluster.local", i, ns)] = &ndspb.NameTable_NameInfo{
			Ips: []string{fmt.Sprintf("10.96.0.%d", i+1)}, Registry: "Kubernetes", Shortname: fmt.Sprint("c", i), Namespace: ns}
	}
	return nt
}

// nameTableHosts returns the hosts of the one NameTable a response
// carries, sorted.
// trustBundle returns the roots of the one ProxyConfig m carries.
func trustBundle(t *testing.T, m proto.Message) []string {
	t.Helper()
	if typeOf(m) != xds.TypeProxyConfig {
		t.Fatalf("got %s, want a ProxyConfig", xds.ShortType(typeOf(m)))
	}
	var as []*anypb.Any
	switch r := m.(type) {
	case *discovery.DiscoveryResponse:
		as = r.GetResources()
	case *discovery.DeltaDiscoveryResponse:
		for _, x := range r.GetResources() {
			as = append(as, x.GetResource())
		}
	}
	if len(as) != 1 {
		t.Fatalf("%d ProxyConfigs in a response, want 1", len(as))
	}
	var pc meshv1alpha1.ProxyConfig
	if err := as[0].UnmarshalTo(&pc); err != nil {
		t.Fatal(err)
	}
	return pc.GetCaCertificatesPem()
}

func nameTableHosts(t *testing.T, m proto.Message) []string {
	t.Helper()
	var bodies [][]byte
	switch r := m.(type) {
	case *discovery.DiscoveryResponse:
		for _, a := range r.GetResources() {
			bodies = append(bodies, a.GetValue())
		}
	case *discovery.DeltaDiscoveryResponse:
		for _, x := range r.GetResources() {
			bodies = append(bodies, x.GetResource().GetValue())
		}
	}
	if len(bodies) != 1 {
		t.Fatalf("%d NameTables in a response, want 1", len(bodies))
	}
	var nt ndspb.NameTable
	if err := proto.Unmarshal(bodies[0], &nt); err != nil {
		t.Fatal(err)
	}
	return slices.Sorted(maps.Keys(nt.GetTable()))
}
