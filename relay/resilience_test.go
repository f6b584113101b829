package relay

import (
	"fmt"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"google.golang.org/protobuf/proto"
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
	c.subscribe(typeCluster)
	take(typeCluster)
	c.subscribe(typeEndpoint, eds...)
	seen := map[string]bool{}
	for len(seen) < len(eds) {
		take(typeEndpoint)
		for _, n := range names(got[typeEndpoint][len(got[typeEndpoint])-1]) {
			seen[n] = true
		}
	}
	c.subscribe(typeListener)
	take(typeListener)
	c.subscribe(typeRoute, "r80")
	take(typeRoute)
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
				for _, typeURL := range []string{typeCluster, typeEndpoint, typeListener, typeRoute} {
					var sub []string
					switch typeURL {
					case typeEndpoint:
						sub = eds
					case typeRoute:
						sub = []string{"r80"}
					}
					c2.send(&discovery.DeltaDiscoveryRequest{TypeUrl: typeURL, ResourceNamesSubscribe: sub, InitialResourceVersions: declaredVersions(held[typeURL])})
				}
				// Wildcard subscriptions are always answered (empty here).
				for range 2 {
					m := c2.recv()
					if len(names(m)) != 0 || len(removedOf(m)) != 0 {
						t.Fatalf("%s after reconnect carried %d resources and %d removals, want none", shortType(typeOf(m)), len(names(m)), len(removedOf(m)))
					}
					resent += proto.Size(m)
					c2.ack(m)
				}
			} else {
				for _, typeURL := range []string{typeCluster, typeEndpoint, typeListener, typeRoute} {
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
				c.UpstreamProtocol = map[bool]Protocol{false: ProtocolSotW, true: ProtocolDelta}[delta]
			})
			conn := dial(t, r.Addr().String())
			old := newRawClient(t, conn, delta, node("ns1", "app", 0))
			syncFull(old, eds)

			up.stop()
			waitFor(t, "key marked stale", func() bool { return r.Stats().StaleKeys == 1 })

			// A new Envoy of the same key is served from the cache.
			fresh := newRawClient(t, conn, delta, node("ns1", "app", 1))
			got, _ := syncFull(fresh, eds)
			if n := len(names(got[typeCluster][0])); n != 20 {
				t.Fatalf("new Envoy got %d clusters from the cache, want 20", n)
			}

			// Content changes while the relay cannot see it.
			up.set("ns1", typeEndpoint, mkCLA("c3", 7777))
			up.restart()
			for _, c := range []*rawClient{old, fresh} {
				m := c.recvSotWOrDelta(typeEndpoint)
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
	up.set("ns1", typeEndpoint, mkCLA("c1", 4242))
	wantNames(t, b.recvSotWOrDelta(typeEndpoint), "c1")
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

var _ types.Resource

// TestWildcardAfterNamed: while the key's only client asks for one cluster
// by name, the key's view holds just that one; a wildcard client joining
// the key must get every cluster, not the partial view.
func TestWildcardAfterNamed(t *testing.T) {
	for _, delta := range []bool{false, true} {
		t.Run(protocolName(delta), func(t *testing.T) {
			e := newEnv(t, delta, nil)
			named := e.client(0)
			named.subscribe(typeCluster, "c0")
			wantNames(t, named.recv(), "c0")
			all := e.client(1)
			all.subscribe(typeCluster)
			wantNames(t, all.recv(), "c0", "c1", "c2")
		})
	}
}
