package relay

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// inboundIP is the pod IP the divergence tests' upstream gives an inbound
// listener of its own, as istiod does for a pod whose IP backs a Service.
const inboundIP = "10.0.0.3"

// inboundUpstream serves every node the "default" group, except the node
// of inboundIP, served the "inbound" group: the same resources plus its own
// listener. Clusters carry a generation (AltStatName "gen-N").
func inboundUpstream(t *testing.T) *testUpstream {
	t.Helper()
	up := newTestUpstreamBy(t, nil, func(n *core.Node) string {
		if n.GetMetadata().GetFields()["INSTANCE_IPS"].GetStringValue() == inboundIP {
			return "inbound"
		}
		return "default"
	}, "default", "inbound")
	for _, g := range []string{"default", "inbound"} {
		setGeneration(up, g, 1)
		for i := range 4 {
			up.set(g, xds.TypeEndpoint, mkCLA(fmt.Sprint("c", i), 8080))
		}
		up.set(g, xds.TypeListener, mkListener("outbound", "r80"))
		up.set(g, xds.TypeRoute, mkRoute("r80", "c0", "c1", "c2", "c3"))
	}
	up.set("inbound", xds.TypeListener, mkListener("inbound|"+inboundIP, "r80"))
	return up
}

func setGeneration(up *testUpstream, group string, gen int) {
	var cs []types.Resource
	for i := range 4 {
		cs = append(cs, mkCluster(fmt.Sprint("c", i), fmt.Sprint("gen-", gen)))
	}
	up.set(group, xds.TypeCluster, cs...)
}

// clusterGeneration reads a test cluster's generation.
func clusterGeneration(m proto.Message) (uint64, bool) {
	c, ok := m.(*cluster.Cluster)
	if !ok || !strings.HasPrefix(c.GetAltStatName(), "gen-") {
		return 0, false
	}
	g, err := strconv.ParseUint(strings.TrimPrefix(c.GetAltStatName(), "gen-"), 10, 64)
	return g, err == nil
}

// watchedEnvoy is a simulated Envoy whose removals the test sees.
type watchedEnvoy struct {
	*envoy.Envoy
	mu      sync.Mutex
	removed []string
}

func startWatchedEnvoy(t *testing.T, addr string, n *core.Node, p envoy.Protocol) *watchedEnvoy {
	t.Helper()
	w := &watchedEnvoy{}
	cfg := envoy.DefaultConfig()
	cfg.Node, cfg.Protocol, cfg.Conn = n, p, dial(t, addr)
	cfg.Generation = clusterGeneration
	cfg.OnEvent = func(ev envoy.Event) {
		if ev.Kind == envoy.Removed {
			w.mu.Lock()
			for _, name := range ev.Names {
				w.removed = append(w.removed, xds.ShortType(ev.TypeURL)+" "+name)
			}
			w.mu.Unlock()
		}
	}
	e, err := envoy.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = e.Stop(ctx)
	})
	w.Envoy = e
	return w
}

func (w *watchedEnvoy) removals() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.removed)
}

// holds reports whether the Envoy holds listener name and every cluster
// at generation gen.
func holds(e *envoy.Envoy, gen uint64, listener string) bool {
	v := e.Resources(envoy.ListenerType)
	if _, ok := v[listener]; !ok {
		return false
	}
	cs := e.Resources(envoy.ClusterType)
	if len(cs) != 4 {
		return false
	}
	for _, c := range cs {
		if c.Generation != gen {
			return false
		}
	}
	return true
}

func keyOfClient(r *Relay, id string) aggkey.Key {
	for _, c := range r.Clients() {
		if c.NodeID == id && c.PeerRelay == "" {
			return c.Key
		}
	}
	return ""
}

// TestDivergenceSplitsKey: four pods of one workload share a key; the
// upstream gives one of them (its IP backs a Service) an inbound listener of
// its own. The divergence check, under churn, finds it: the key splits,
// only that pod's Envoy moves to a key of its own and gets its listener,
// none of the Envoys sees a removal or an older cluster, and the metric
// counts the divergence. In a tier, the diverging Envoy is connected to a
// relay that gets the key from its owner: that relay asks the owner to
// check it, and the owner's split reaches it.
func TestDivergenceSplitsKey(t *testing.T) {
	for _, tc := range []struct {
		name     string
		upstream Protocol
		envoy    envoy.Protocol
		tier     bool
	}{
		{"delta upstream, delta envoys", ProtocolDelta, envoy.Delta, false},
		{"sotw upstream, sotw envoys", ProtocolSotW, envoy.SotW, false},
		{"tier, diverging envoy at the owner's peer", ProtocolDelta, envoy.Delta, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := inboundUpstream(t)
			withChecks := func(c *Config) {
				c.Upstream.Protocol = tc.upstream
				c.Keys.DivergenceInterval = 200 * time.Millisecond
			}
			owner := startRelay(t, up, func(c *Config) { withChecks(c); c.ID = "owner" })
			// Where each of the four Envoys connects: the owner, or in the
			// tier case the owner's peer for Envoys 1 and 2.
			at := []*Relay{owner, owner, owner, owner}
			if tc.tier {
				other := startRelay(t, up, func(c *Config) {
					withChecks(c)
					c.ID = "other"
					c.Tier.Owners = newFakeOwners(owner.Addr().String(), false)
				})
				at[1], at[2] = other, other
			}
			nodes := []*core.Node{node("default", "reviews", 0), node("default", "reviews", 1), node("default", "reviews", 2), node("default", "reviews", 3)}
			if ip := nodes[2].GetMetadata().GetFields()["INSTANCE_IPS"].GetStringValue(); ip != inboundIP {
				t.Fatalf("node 2 has IP %s, want %s", ip, inboundIP)
			}
			// Envoy 0's node is the one the key presents upstream, and in
			// the tier Envoy 1's the one the peer presents to the owner.
			var envoys []*watchedEnvoy
			for i, n := range nodes {
				envoys = append(envoys, startWatchedEnvoy(t, at[i].Addr().String(), n, tc.envoy))
				if i < 2 {
					waitLong(t, fmt.Sprint("Envoy ", i, "'s config"), func() bool { return holds(envoys[i].Envoy, 1, "outbound") })
				}
			}
			// In the tier, an Envoy of another key on the peer too.
			var ratings *watchedEnvoy
			if tc.tier {
				ratings = startWatchedEnvoy(t, at[1].Addr().String(), node("default", "ratings", 5), tc.envoy)
			}
			// Churn while the checks run: a bounded number of pushes.
			gen := 1
			for range 30 {
				gen++
				setGeneration(up, "default", gen)
				setGeneration(up, "inbound", gen)
				time.Sleep(20 * time.Millisecond)
			}
			last := uint64(gen)
			waitLong(t, "the diverging Envoy's own listener", func() bool {
				return holds(envoys[2].Envoy, last, "inbound|"+inboundIP)
			})
			for i, e := range envoys {
				waitLong(t, fmt.Sprint("Envoy ", i, " at the last generation"), func() bool { return holds(e.Envoy, last, "outbound") })
			}
			base, _ := owner.cache.keyOf(nodes[0], nil)
			for i, n := range nodes {
				want := base
				if i == 2 {
					want = aggkey.SplitKey(n)
				}
				if got := keyOfClient(at[i], n.GetId()); got != want {
					t.Errorf("Envoy %d is on key %q, want %q", i, got, want)
				}
			}
			for i, e := range envoys {
				if i != 2 && len(e.Resources(envoy.ListenerType)) != 1 {
					t.Errorf("Envoy %d holds listeners %v, want only outbound", i, e.Resources(envoy.ListenerType))
				}
				if rm := e.removals(); len(rm) > 0 {
					t.Errorf("Envoy %d saw removals %q", i, rm)
				}
				for _, v := range e.Violations() {
					t.Errorf("Envoy %d: %v", i, v)
				}
			}
			if n := testutil.ToFloat64(owner.metrics.Divergences.WithLabelValues("lds")); n != 1 {
				t.Errorf("meshrelay_key_divergences_total{type=lds} = %v, want 1", n)
			}
			for _, r := range []*Relay{owner, at[2]} {
				if splits := r.cache.splits.of(base); len(splits) != 1 || !splits[0].Matches(nodes[2]) || splits[0].Matches(nodes[1]) {
					t.Errorf("%s: splits of %s = %v, want one that moves node 2 alone", r.ID(), base, splits)
				}
				// The admin API's account (relayctl shards) of the key.
				sum := r.Ledger().Summary(ledger.Scope{Key: string(base)}, time.Now(), ledger.Brief)
				if len(sum.Keys) != 1 || len(sum.Keys[0].Splits) != 1 || !strings.Contains(sum.Keys[0].Splits[0], nodes[2].GetId()) {
					t.Errorf("%s: the ledger's summary of %s = %+v, want the split of node 2", r.ID(), base, sum.Keys)
				}
			}
			// The members alike were checked too, and stayed.
			waitLong(t, "a check that found the same config", func() bool {
				return testutil.ToFloat64(owner.metrics.DivergenceChecks.WithLabelValues("same")) >= 1
			})
			if got := keyOfClient(at[3], nodes[3].GetId()); got != base {
				t.Errorf("after more checks, Envoy 3 is on key %q, want %q", got, base)
			}
			if tc.tier {
				// A push after the split reaches another key's peer
				// stream: the split of this key does not end it. Only
				// the split key's peer stream ended (to learn the split).
				gen++
				setGeneration(up, "default", gen)
				setGeneration(up, "inbound", gen)
				waitLong(t, "the other key's Envoy at the push after the split", func() bool { return holds(ratings.Envoy, uint64(gen), "outbound") })
				if n := testutil.ToFloat64(owner.metrics.StreamErrors.WithLabelValues("Aborted")); n != 1 {
					t.Errorf("streams the owner ended ABORTED = %v, want 1 (the split key's peer stream)", n)
				}
				open := 3 // the key's, the split key's and the other key's
				waitLong(t, "three upstream streams", func() bool { n, _ := up.streams(); return n == open })
				return
			}
			// The key's stream and the split key's: no check's stays open.
			waitLong(t, "two upstream streams", func() bool { open, _ := up.streams(); return open == 2 })
		})
	}
}

// waitLong is waitFor with a bound that a loaded machine meets: two
// minutes.
func waitLong(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestDivergenceCheckWaitsForSlot: a key that gets its second member while
// the relay runs as many checks as it may is checked as soon as a slot
// frees, not at its next turn a DivergenceInterval later.
func TestDivergenceCheckWaitsForSlot(t *testing.T) {
	up := inboundUpstream(t)
	r := startRelay(t, up, func(c *Config) { c.Keys.DivergenceInterval = time.Hour })
	for range maxDivergenceChecks {
		r.checkSlots <- struct{}{} // every slot taken
	}
	first, diverging := node("default", "reviews", 0), node("default", "reviews", 2)
	e0 := startWatchedEnvoy(t, r.Addr().String(), first, envoy.Delta)
	waitLong(t, "Envoy 0's config", func() bool { return holds(e0.Envoy, 1, "outbound") })
	e2 := startWatchedEnvoy(t, r.Addr().String(), diverging, envoy.Delta)
	waitLong(t, "Envoy 2's config", func() bool { return holds(e2.Envoy, 1, "outbound") })
	time.Sleep(1500 * time.Millisecond) // the checks' ticks find no slot
	if s := r.Splits(); len(s) != 0 {
		t.Fatalf("Splits() = %v with no check slot, want none", s)
	}
	for range maxDivergenceChecks {
		<-r.checkSlots
	}
	waitLong(t, "the diverging Envoy's own listener", func() bool { return holds(e2.Envoy, 1, "inbound|"+inboundIP) })
	if s := r.Splits(); len(s) != 1 || !strings.Contains(s[0].Split, diverging.GetId()) {
		t.Errorf("Splits() = %v, want one moving %s", s, diverging.GetId())
	}
}

// TestDivergenceCheckAtJoinComparesEverything: two pods join a key at once,
// one of them diverging in its listeners. The check run as the second
// joins must compare every type the key's Envoys come to subscribe to: an
// Envoy asks for listeners only once it has clusters, and a check that
// compared the clusters alone would find them the same, and leave the key
// unchecked until the next turn, an hour later here. Whichever pod's node
// the key presents, the two end up on keys of their own config. (If the
// key presented the diverging pod, the other held its inbound listener
// until the split, and loses it then: the one removal allowed.)
func TestDivergenceCheckAtJoinComparesEverything(t *testing.T) {
	up := inboundUpstream(t)
	r := startRelay(t, up, func(c *Config) { c.Keys.DivergenceInterval = time.Hour })
	a := startWatchedEnvoy(t, r.Addr().String(), node("default", "reviews", 0), envoy.Delta)
	b := startWatchedEnvoy(t, r.Addr().String(), node("default", "reviews", 2), envoy.Delta)
	waitLong(t, "a split, and each Envoy on its own config", func() bool {
		return len(r.Splits()) == 1 && holds(b.Envoy, 1, "inbound|"+inboundIP) &&
			holds(a.Envoy, 1, "outbound") && len(a.Resources(envoy.ListenerType)) == 1
	})
	for _, e := range []*watchedEnvoy{a, b} {
		rm := e.removals()
		if e == a {
			rm = slices.DeleteFunc(rm, func(s string) bool { return s == "lds inbound|"+inboundIP })
		}
		if len(rm) > 0 {
			t.Errorf("%s saw removals %q", e.ID(), rm)
		}
		for _, v := range e.Violations() {
			t.Errorf("%s: %v", e.ID(), v)
		}
	}
}

// TestRemovedNameKeptByASubscriptionIsNoDivergence is issue 28's third bug
// at its root. With a SotW upstream, a key's view keeps a removed
// service's endpoints while any member still asks for them by name (the
// upstream never says a name asked for by name is gone; a relay frozen for
// a while, which cannot pass its Envoys' unsubscriptions on, keeps asking).
// A check's own stream asks for the same name and is sent nothing of it:
// that difference is not in what the upstream gives two nodes, and must
// not split the key (it used to, and the key's split members each cost an
// upstream stream from then on).
func TestRemovedNameKeptByASubscriptionIsNoDivergence(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	seed(up, "ns1", 3)
	up.set("ns1", xds.TypeEndpoint, mkCLA("gone", 7000))
	r := startRelay(t, up, func(c *Config) {
		c.Upstream.Protocol = ProtocolSotW
		c.Keys.DivergenceInterval = time.Hour // only the check of the second member
	})
	conn := dial(t, r.Addr().String())
	first := newRawClient(t, conn, false, node("ns1", "app", 0))
	first.subscribe(xds.TypeEndpoint, "c0", "c1", "c2", "gone")
	first.ack(first.recv())
	up.del("ns1", xds.TypeEndpoint, "gone") // the client asks for it still
	second := newRawClient(t, conn, false, node("ns1", "app", 1))
	second.subscribe(xds.TypeEndpoint, "c0", "c1", "c2", "gone")
	second.ack(second.recv())
	waitLong(t, "the second member's check", func() bool {
		return testutil.ToFloat64(r.metrics.DivergenceChecks.WithLabelValues("same"))+
			testutil.ToFloat64(r.metrics.DivergenceChecks.WithLabelValues("diverged")) > 0
	})
	if n := testutil.ToFloat64(r.metrics.DivergenceChecks.WithLabelValues("diverged")); n != 0 {
		t.Fatalf("the check found a divergence (%v) in a name only the key's view keeps; splits: %v", n, r.Splits())
	}
	if _, ok := r.cache.heldKeys()[0].views.Load().Types[xds.TypeEndpoint].View.Get("gone"); !ok {
		t.Fatal("the key's view no longer holds the removed name: the test checks nothing")
	}
}

// TestSplitMergedBack: a split lasts while checks prove it. The pod whose
// IP backed a Service (its inbound listener set it apart) stops backing
// it: the upstream gives it the key's config again. The relay that serves
// its Envoy checks it against the key it left, now and then; it finds the
// same config, merges the split back, and the Envoy returns to the key,
// make-before-break, with no older content and nothing removed but the
// listener the upstream removed. The split key's upstream stream closes at
// once (nobody comes back to it): one upstream stream for the key again.
// In a tier, the relay that serves the Envoy asks the key's owner, which
// merges the split back and tells the relay.
func TestSplitMergedBack(t *testing.T) {
	for _, tier := range []bool{false, true} {
		t.Run(map[bool]string{false: "one relay", true: "envoy at the owner's peer"}[tier], func(t *testing.T) {
			up := inboundUpstream(t)
			withChecks := func(c *Config) { c.Keys.DivergenceInterval = 200 * time.Millisecond }
			owner := startRelay(t, up, func(c *Config) { withChecks(c); c.ID = "owner" })
			at := owner
			if tier {
				at = startRelay(t, up, func(c *Config) {
					withChecks(c)
					c.ID = "other"
					c.Tier.Owners = newFakeOwners(owner.Addr().String(), false)
				})
			}
			nodes := []*core.Node{node("default", "reviews", 0), node("default", "reviews", 1), node("default", "reviews", 2)}
			var envoys []*watchedEnvoy
			for i, n := range nodes {
				addr := owner.Addr().String()
				if i == 2 {
					addr = at.Addr().String()
				}
				envoys = append(envoys, startWatchedEnvoy(t, addr, n, envoy.Delta))
				waitLong(t, fmt.Sprint("Envoy ", i, "'s config"), func() bool { return holds(envoys[i].Envoy, 1, "outbound") })
			}
			base, _ := owner.cache.keyOf(nodes[0], nil)
			waitLong(t, "the split", func() bool { return keyOfClient(at, nodes[2].GetId()) == aggkey.SplitKey(nodes[2]) })
			waitLong(t, "the diverging Envoy's own listener", func() bool { return holds(envoys[2].Envoy, 1, "inbound|"+inboundIP) })

			up.del("inbound", xds.TypeListener, "inbound|"+inboundIP)
			waitLong(t, "the Envoy back on its key", func() bool { return keyOfClient(at, nodes[2].GetId()) == base })
			if n := testutil.ToFloat64(owner.metrics.SplitMerges); n != 1 {
				t.Errorf("meshrelay_key_split_merges_total = %v at the owner, want 1", n)
			}
			for _, r := range []*Relay{owner, at} {
				if s := r.cache.splits.active(base); len(s) != 0 {
					t.Errorf("%s: active splits of %s = %v, want none", r.ID(), base, s)
				}
			}
			// A push after the merge reaches it through the key.
			setGeneration(up, "default", 2)
			setGeneration(up, "inbound", 2)
			for i, e := range envoys {
				waitLong(t, fmt.Sprint("Envoy ", i, " at generation 2"), func() bool { return holds(e.Envoy, 2, "outbound") })
				for _, v := range e.Violations() {
					t.Errorf("Envoy %d: %v", i, v)
				}
			}
			if rm := envoys[2].removals(); !slices.Equal(rm, []string{"lds inbound|" + inboundIP}) {
				t.Errorf("the Envoy that returned saw removals %q, want its inbound listener only", rm)
			}
			waitLong(t, "one upstream stream", func() bool { open, _ := up.streams(); return open == 1 })
		})
	}
}

// TestSplitTheOwnerNeverKnewIsMergedBack: a relay cut off from the key's
// owner splits a key there (its own check), and the owner never hears of
// it. Once the link is back, the relay's re-check asks the owner, which
// finds the same config but has no split of its own to merge back: the
// relay that found the split merges it back, and its Envoy returns to the
// key (it stayed on a key of its own, and cost an upstream stream, for as
// long as the relays ran: issue 28's simulation, seed 1137 under -race).
func TestSplitTheOwnerNeverKnewIsMergedBack(t *testing.T) {
	up := newTestUpstream(t, "ns0")
	seed(up, "ns0", 3)
	withChecks := func(c *Config) { c.Keys.DivergenceInterval = 200 * time.Millisecond }
	owner := startRelay(t, up, func(c *Config) { withChecks(c); c.ID = "owner" })
	at := startRelay(t, up, func(c *Config) {
		withChecks(c)
		c.ID = "other"
		c.Tier.Owners = newFakeOwners(owner.Addr().String(), false)
	})
	presented, diverging := node("ns0", "app", 0), node("ns0", "app", 1)
	base := splitHere(at, presented, diverging)

	syncAll(newRawClient(t, dial(t, owner.Addr().String()), false, presented))
	moved := newRawClient(t, dial(t, at.Addr().String()), false, diverging)
	syncAll(moved)
	if k := keyOfClient(at, diverging.GetId()); k != aggkey.SplitKey(diverging) {
		t.Fatalf("the diverging Envoy is on %q, not a key of its own: the test tests nothing", k)
	}
	waitLong(t, "the Envoy back on its key", func() bool { return keyOfClient(at, diverging.GetId()) == base })
	if n := testutil.ToFloat64(at.metrics.SplitMerges); n != 1 {
		t.Errorf("meshrelay_key_split_merges_total = %v at the relay that split the key, want 1", n)
	}
	if s := at.cache.splits.active(base); len(s) != 0 {
		t.Errorf("active splits of %s = %v, want none", base, s)
	}
	waitLong(t, "one upstream stream", func() bool { open, _ := up.streams(); return open == 1 })
}

// TestSplitKeyNobodyComesBackToIsDropped: a key's owner serves another
// relay a key of a node of its own (a split the owner never heard of);
// once that relay leaves it, nobody comes back to it, and the owner drops
// it and its upstream stream at once instead of idling for Keys.IdleTimeout.
func TestSplitKeyNobodyComesBackToIsDropped(t *testing.T) {
	up := newTestUpstream(t, "ns0")
	seed(up, "ns0", 3)
	owner := startRelay(t, up, func(c *Config) {
		c.ID = "owner"
		c.Keys.DivergenceInterval = 0
		c.Keys.IdleTimeout = time.Hour
	})
	at := startRelay(t, up, func(c *Config) {
		c.ID = "other"
		c.Keys.DivergenceInterval = 0
		c.Keys.IdleTimeout = 100 * time.Millisecond
		c.Tier.Owners = newFakeOwners(owner.Addr().String(), false)
	})
	presented, diverging := node("ns0", "app", 0), node("ns0", "app", 1)
	splitHere(at, presented, diverging)

	syncAll(newRawClient(t, dial(t, owner.Addr().String()), false, presented))
	moved := newRawClient(t, dial(t, at.Addr().String()), false, diverging)
	syncAll(moved)
	if k := keyOfClient(at, diverging.GetId()); k != aggkey.SplitKey(diverging) {
		t.Fatalf("the diverging Envoy is on %q, not a key of its own: the test tests nothing", k)
	}
	waitLong(t, "the split key's upstream stream at the owner", func() bool { open, _ := up.streams(); return open == 2 })
	moved.close()
	waitLong(t, "one upstream stream", func() bool { open, _ := up.streams(); return open == 1 })
}

// splitHere makes r alone know a split of presented's key that moves
// diverging (found there, told to nobody), and returns that key.
func splitHere(r *Relay, presented, diverging *core.Node) aggkey.Key {
	base, _ := r.cache.keyOf(presented, nil)
	s := aggkey.NewSplit(diverging, presented)
	s.Epoch = uint64(r.cache.clock.Now())
	r.cache.learnSplits(base, []aggkey.Split{s})
	return base
}
