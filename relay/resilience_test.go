package relay

import (
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/relay/xds"
)

// seedN fills group g with n services and returns the EDS names.
func seedN(up *testUpstream, g string, n int) []string {
	seed(up, g, n)
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprint("c", i)
	}
	return out
}

// syncFull subscribes to all four types and receives until every EDS name
// has arrived, returning the responses by type (Delta: all of them) and
// their total size.
func syncFull(c *rawClient, eds []string) (map[string][]proto.Message, int) {
	c.t.Helper()
	got := map[string][]proto.Message{}
	size := 0
	take := func(typeURL string) {
		m := c.recvSotWOrDelta(typeURL)
		c.ack(m)
		got[typeURL] = append(got[typeURL], m)
		size += proto.Size(m)
	}
	c.subscribe(xds.TypeCluster)
	take(xds.TypeCluster)
	c.subscribe(xds.TypeEndpoint, eds...)
	seen := map[string]bool{}
	for len(seen) < len(eds) {
		take(xds.TypeEndpoint)
		for _, n := range names(got[xds.TypeEndpoint][len(got[xds.TypeEndpoint])-1]) {
			seen[n] = true
		}
	}
	c.subscribe(xds.TypeListener)
	take(xds.TypeListener)
	c.subscribe(xds.TypeRoute, "r80")
	take(xds.TypeRoute)
	return got, size
}

// declaredVersions merges the Delta responses of a type into
// initial_resource_versions.
func declaredVersions(ms []proto.Message) map[string]string {
	out := map[string]string{}
	for _, m := range ms {
		d := m.(*discovery.DeltaDiscoveryResponse)
		for _, x := range d.GetResources() {
			out[x.GetName()] = x.GetVersion()
		}
		for _, n := range d.GetRemovedResources() {
			delete(out, n)
		}
	}
	return out
}

// TestReconnectToFreshRelay: an Envoy that held full config reconnects to a
// relay with no state at all (a new process, same upstream content). Delta:
// it is sent at most 1% of its full state again. SotW: it is sent no
// response whose content differs from what it holds (here: none at all).
func TestReconnectToFreshRelay(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocolName(delta), func(t *testing.T) {
			up := newTestUpstream(t, "ns1")
			eds := seedN(up, "ns1", 300)
			r1 := startRelay(t, up, nil)
			c := newRawClient(t, dial(t, r1.Addr().String()), delta, node("ns1", "app", 0))
			held, full := syncFull(c, eds)
			c.close()

			r2 := startRelay(t, up, func(c *Config) { c.ID = "fresh" })
			c2 := newRawClient(t, dial(t, r2.Addr().String()), delta, node("ns1", "app", 0))
			resent := 0
			if delta {
				for _, typeURL := range []string{xds.TypeCluster, xds.TypeEndpoint, xds.TypeListener, xds.TypeRoute} {
					var sub []string
					switch typeURL {
					case xds.TypeEndpoint:
						sub = eds
					case xds.TypeRoute:
						sub = []string{"r80"}
					}
					c2.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesSubscribe: sub, InitialResourceVersions: declaredVersions(held[typeURL])})
				}
				// Wildcard subscriptions are always answered (empty here).
				for range 2 {
					m := c2.recv()
					if len(names(m)) != 0 || len(removedOf(m)) != 0 {
						t.Fatalf("%s after reconnect carried %d resources and %d removals, want none", xds.ShortType(typeOf(m)), len(names(m)), len(removedOf(m)))
					}
					resent += proto.Size(m)
					c2.ack(m)
				}
			} else {
				for _, typeURL := range []string{xds.TypeCluster, xds.TypeEndpoint, xds.TypeListener, xds.TypeRoute} {
					last := held[typeURL][len(held[typeURL])-1].(*discovery.DiscoveryResponse)
					sub := c.subs[typeURL]
					c2.subs[typeURL] = sub
					c2.send(&discovery.DiscoveryRequest{TypeUrl: typeURL, ResourceNames: sub, VersionInfo: last.GetVersionInfo()})
				}
			}
			c2.quiet()
			if limit := full / 100; resent > limit {
				t.Fatalf("re-sent %d bytes of a %d-byte state, want at most 1%% (%d)", resent, full, limit)
			}
			t.Logf("full state %d bytes, re-sent %d bytes (%.3f%%)", full, resent, 100*float64(resent)/float64(full))
		})
	}
}

// TestUpstreamRestart: the upstream dies. Envoys keep their config (no
// removal reaches them), a new Envoy is served from the cache, the key is
// marked stale; when the upstream returns with changed content everything
// converges.
func TestUpstreamRestart(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocolName(delta), func(t *testing.T) {
			up := newTestUpstream(t, "ns1")
			eds := seedN(up, "ns1", 20)
			r := startRelay(t, up, func(c *Config) {
				c.Upstream.Protocol = map[bool]Protocol{false: ProtocolSotW, true: ProtocolDelta}[delta]
			})
			conn := dial(t, r.Addr().String())
			old := newRawClient(t, conn, delta, node("ns1", "app", 0))
			syncFull(old, eds)

			up.stop()
			waitFor(t, "key marked stale", func() bool { return r.Stats().StaleKeys == 1 })

			// A new Envoy of the same key is served from the cache.
			fresh := newRawClient(t, conn, delta, node("ns1", "app", 1))
			got, _ := syncFull(fresh, eds)
			if n := len(names(got[xds.TypeCluster][0])); n != 20 {
				t.Fatalf("new Envoy got %d clusters from the cache, want 20", n)
			}

			// Content changes while the relay cannot see it.
			up.set("ns1", xds.TypeEndpoint, mkCLA("c3", 7777))
			up.restart()
			for _, c := range []*rawClient{old, fresh} {
				m := c.recvSotWOrDelta(xds.TypeEndpoint)
				wantNames(t, m, "c3")
				if len(removedOf(m)) != 0 {
					t.Fatalf("removals %v reached an Envoy across the upstream restart", removedOf(m))
				}
				c.ack(m)
				c.quiet()
			}
			waitFor(t, "key fresh again", func() bool { return r.Stats().StaleKeys == 0 })
			if open, _ := up.streams(); open != 1 {
				t.Fatalf("upstream streams after restart = %d, want 1", open)
			}
		})
	}
}

// TestRehome: the key's upstream stream presents its first member's node;
// when that Envoy leaves, the stream moves to a live member's node.
func TestRehome(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	eds := seedN(up, "ns1", 3)
	r := startRelay(t, up, nil)
	conn := dial(t, r.Addr().String())
	a := newRawClient(t, conn, true, node("ns1", "app", 0))
	syncFull(a, eds)
	b := newRawClient(t, conn, true, node("ns1", "app", 1))
	syncFull(b, eds)
	if got := lastUpstreamNode(up); got != a.node.GetId() {
		t.Fatalf("upstream stream presents %q, want the first member %q", got, a.node.GetId())
	}
	a.close()
	waitFor(t, "re-homed to the live member", func() bool { return lastUpstreamNode(up) == b.node.GetId() })
	waitFor(t, "one upstream stream", func() bool { open, _ := up.streams(); return open == 1 })
	// b still gets updates through the new stream.
	up.set("ns1", xds.TypeEndpoint, mkCLA("c1", 4242))
	wantNames(t, b.recvSotWOrDelta(xds.TypeEndpoint), "c1")
}

// lastUpstreamNode returns the node of the latest first request the
// upstream saw.
func lastUpstreamNode(up *testUpstream) string {
	up.mu.Lock()
	defer up.mu.Unlock()
	for i := len(up.deltaReq) - 1; i >= 0; i-- {
		if id := up.deltaReq[i].GetNode().GetId(); id != "" {
			return id
		}
	}
	return ""
}

// waitFor polls cond (every 5 ms, for up to 10 s): for states that only a
// background goroutine reaches, with no event to wait on.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestWildcardAfterNamed: while the key's only client asks for one cluster
// by name, the key's view holds just that one; a wildcard client joining
// the key must get every cluster, not the partial view.
func TestWildcardAfterNamed(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocolName(delta), func(t *testing.T) {
			e := newEnv(t, delta, nil)
			named := e.client(0)
			named.subscribe(xds.TypeCluster, "c0")
			wantNames(t, named.recv(), "c0")
			all := e.client(1)
			all.subscribe(xds.TypeCluster)
			wantNames(t, all.recv(), "c0", "c1", "c2")
		})
	}
}

// TestReconnectDeclaresState: across an upstream restart the relay's new
// stream carries, per type, the last ACKed SotW version with no nonce, or
// (Delta) the versions the key holds, so the upstream sends only what
// changed.
func TestReconnectDeclaresState(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocolName(delta), func(t *testing.T) {
			up := newTestUpstream(t, "ns1")
			eds := seedN(up, "ns1", 5)
			r := startRelay(t, up, func(c *Config) {
				c.Upstream.Protocol = map[bool]Protocol{false: ProtocolSotW, true: ProtocolDelta}[delta]
			})
			c := newRawClient(t, dial(t, r.Addr().String()), true, node("ns1", "app", 0))
			syncFull(c, eds)
			up.mu.Lock()
			beforeSotW, beforeDelta := len(up.sotwReqs), len(up.deltaReq)
			var acked string
			for _, q := range up.sotwReqs {
				if q.GetTypeUrl() == xds.TypeCluster && q.GetVersionInfo() != "" {
					acked = q.GetVersionInfo()
				}
			}
			up.mu.Unlock()
			up.stop()
			up.restart()
			waitFor(t, "the relay's requests on the new stream", func() bool {
				up.mu.Lock()
				defer up.mu.Unlock()
				return len(up.sotwReqs)+len(up.deltaReq) > beforeSotW+beforeDelta+3
			})
			up.mu.Lock()
			defer up.mu.Unlock()
			if delta {
				for _, q := range up.deltaReq[beforeDelta:] {
					if q.GetTypeUrl() == xds.TypeCluster && q.GetResponseNonce() == "" {
						if len(q.GetInitialResourceVersions()) != 5 {
							t.Fatalf("CDS on the new stream declares %d resources, want 5", len(q.GetInitialResourceVersions()))
						}
						return
					}
				}
				t.Fatal("no first CDS request on the new stream")
			}
			for _, q := range up.sotwReqs[beforeSotW:] {
				if q.GetTypeUrl() == xds.TypeCluster {
					if q.GetResponseNonce() != "" || q.GetVersionInfo() != acked || acked == "" {
						t.Fatalf("CDS on the new stream: version %q nonce %q, want version %q and no nonce", q.GetVersionInfo(), q.GetResponseNonce(), acked)
					}
					return
				}
			}
			t.Fatal("no CDS request on the new stream")
		})
	}
}

// TestBackoff: reconnects to an unreachable upstream are spaced by a
// jittered exponential backoff (xds-relay #68 measured 56,000 attempts a
// second without one).
func TestBackoff(t *testing.T) {
	r := newTestRelay(t)
	b := r.cache.newBackoff()
	want := r.cfg.Upstream.BackoffInitial
	for i := range 12 {
		d := b.next()
		if d < want/2 || d > want {
			t.Fatalf("attempt %d waits %v, want within [%v, %v]", i, d, want/2, want)
		}
		want = min(2*want, r.cfg.Upstream.BackoffMax)
	}
	b.reset()
	if d := b.next(); d > r.cfg.Upstream.BackoffInitial {
		t.Fatalf("after reset the wait is %v, want at most %v", d, r.cfg.Upstream.BackoffInitial)
	}
}

// TestUpstreamDownIsNotHammered: with the upstream refusing connections,
// the relay's attempts stay few (backoff), whatever the number of Envoys.
func TestUpstreamDownIsNotHammered(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var accepts atomic.Int32
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			accepts.Add(1)
			c.Close() // not an ADS server: every stream fails at once
		}
	}()
	defer func() { lis.Close(); <-done }()
	up := &testUpstream{addr: lis.Addr().String()}
	r := startRelay(t, up, func(c *Config) {
		c.Upstream.BackoffInitial, c.Upstream.BackoffMax = 50*time.Millisecond, 400*time.Millisecond
		c.XDS.WarmWait = -1 // serve the streams though the upstream was never reached
	})
	conn := dial(t, r.Addr().String())
	for i := range 20 {
		c := newRawClient(t, conn, true, node(fmt.Sprint("ns", i%4), "app", i))
		c.subscribe(xds.TypeCluster)
	}
	time.Sleep(2 * time.Second) // the window in which attempts are counted
	// 4 keys, each backing off from 50 ms to 400 ms over 2 s: about 10
	// attempts a key. Without backoff it would be thousands.
	if n := accepts.Load(); n > 80 {
		t.Fatalf("%d connection attempts in 2 s for 4 keys, want backoff to keep it under 80", n)
	}
}

// TestCacheSharesResources: keys with the same content hold each resource
// once; the cache grows with unique resources, not keys × resources.
func TestCacheSharesResources(t *testing.T) {
	const keys, services = 10, 50
	var groups []string
	for i := range keys {
		groups = append(groups, fmt.Sprint("ns", i))
	}
	up := newTestUpstream(t, groups...)
	for _, g := range groups {
		seed(up, g, services) // the same content in every namespace
	}
	r := startRelay(t, up, nil)
	conn := dial(t, r.Addr().String())
	eds := make([]string, services)
	for i := range eds {
		eds[i] = fmt.Sprint("c", i)
	}
	var clients []*rawClient // kept open: their keys hold the views
	for i, g := range groups {
		c := newRawClient(t, conn, true, node(g, "app", i))
		syncFull(c, eds)
		clients = append(clients, c)
	}
	if got := r.Stats().Keys; got != keys {
		t.Fatalf("keys = %d, want %d", got, keys)
	}
	// Per key: 50 clusters, 50 endpoints, a listener, a route: 102 unique
	// resources whatever the number of keys (runtime barriers are not
	// subscribed here).
	if got, want := r.store.Len(), 2*services+2; got != want {
		t.Fatalf("cache holds %d resources for %d keys of identical content, want %d", got, keys, want)
	}
}

// TestWildcardLeavesAndReturns: a key with a named and a wildcard client;
// the wildcard one leaves, so the key asks only for the named cluster and
// its view shrinks; a wildcard client joining then must wait for the full
// set, not be told that the other clusters were removed.
func TestWildcardLeavesAndReturns(t *testing.T) {
	e := newEnv(t, true, nil)
	named := e.client(0)
	named.subscribe(xds.TypeCluster, "c0")
	wantNames(t, named.recv(), "c0")
	all := e.client(1)
	all.subscribe(xds.TypeCluster)
	d := all.recv().(*discovery.DeltaDiscoveryResponse)
	wantNames(t, d, "c0", "c1", "c2")
	all.close()
	waitFor(t, "the key's view to shrink to c0", func() bool {
		for _, k := range e.r.cache.heldKeys() {
			if ts := k.views.Load().Types[xds.TypeCluster]; ts != nil && ts.View.Len() == 1 {
				return true
			}
		}
		return false
	})
	back := e.client(1)
	back.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster, InitialResourceVersions: versionMap(d)})
	m := back.recvSotWOrDelta(xds.TypeCluster)
	if r := removedOf(m); len(r) != 0 {
		t.Fatalf("a returning wildcard client was told %v were removed; they exist", r)
	}
}

// TestDeltaFirstRequestUnsubscribes: a first Delta request that subscribes
// and unsubscribes the wildcard in one go subscribes to its names only.
func TestDeltaFirstRequestUnsubscribes(t *testing.T) {
	e := newEnv(t, true, nil)
	c := e.client(0)
	c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster,
		ResourceNamesSubscribe: []string{xds.WildcardName, "c0"}, ResourceNamesUnsubscribe: []string{xds.WildcardName}})
	wantNames(t, c.recv(), "c0")
	c.quiet()
}

// TestPassthroughReplay: across an upstream restart, a client's
// passthrough subscriptions are asked again as plain requests: not as the
// NACK it last sent (an upstream ignores a NACK, and the client would wait
// forever), and not as a wildcard when it subscribes to nothing.
func TestPassthroughReplay(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocolName(delta), func(t *testing.T) {
			e := newEnv(t, delta, nil)
			c := e.client(0)
			c.subscribe(typeOther)
			c.nack(c.recv(), "")
			if delta {
				c.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeOther, ResourceNamesUnsubscribe: []string{xds.WildcardName}})
			}
			c.quiet(typeOther) // the upstream may answer the NACK; leave it so
			// The client's last request is forwarded asynchronously: count
			// what comes after it has reached the upstream.
			waitFor(t, "the last passthrough request to reach the upstream", func() bool {
				e.up.mu.Lock()
				defer e.up.mu.Unlock()
				for _, q := range e.up.sotwReqs {
					if q.GetTypeUrl() == typeOther && q.GetErrorDetail() != nil {
						return true
					}
				}
				for _, q := range e.up.deltaReq {
					if q.GetTypeUrl() == typeOther && len(q.GetResourceNamesUnsubscribe()) > 0 {
						return true
					}
				}
				return false
			})
			e.up.mu.Lock()
			beforeSotW, beforeDelta := len(e.up.sotwReqs), len(e.up.deltaReq)
			e.up.mu.Unlock()
			e.up.stop()
			e.up.restart()
			c.quiet(typeOther) // the key's stream is back; the passthrough one too, or soon
			waitFor(t, "the passthrough stream to reconnect", func() bool {
				open, _ := e.up.streams()
				return open == 2 // the key's and the client's passthrough
			})
			c.quiet(typeOther) // and whatever it replays has reached the upstream
			e.up.mu.Lock()
			defer e.up.mu.Unlock()
			for _, q := range e.up.sotwReqs[beforeSotW:] {
				if q.GetTypeUrl() == typeOther && q.GetErrorDetail() != nil {
					t.Fatalf("the NACK was replayed on the new stream: %v", q)
				}
			}
			for _, q := range e.up.deltaReq[beforeDelta:] {
				if q.GetTypeUrl() == typeOther {
					t.Fatalf("a subscription to nothing was replayed as %v", q)
				}
			}
		})
	}
}
