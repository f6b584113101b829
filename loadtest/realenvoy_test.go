package loadtest

import (
	"context"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/realenvoy/install"

	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/traffic"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/realenvoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/snapshot"
)

// The real-Envoy tests: a real Envoy 1.40 (loadtest/realenvoy) bootstraps
// to a 3-relay tier's Service, the synthetic upstream behind it, and the
// test sends HTTP requests through the Envoy's listener to backends it runs
// on loopback.

// protocol is an ADS protocol the real-Envoy tests run with.
type protocol struct {
	name  string
	delta bool
}

// protocols are the ADS protocols every real-Envoy test runs with.
var protocols = []protocol{{"sotw", false}, {"delta", true}}

// eachProtocol runs fn as a subtest per protocol (i is its index: each
// takes a namespace of its own), with at most a minute of ctx each.
func eachProtocol(t *testing.T, ctx context.Context, fn func(t *testing.T, ctx context.Context, i int, p protocol)) {
	for i, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			fn(t, ctx, i, p)
		})
	}
}

// realEnvoyWorld is an upstream with an HTTP service "web" and a tier in
// front of it.
type realEnvoyWorld struct {
	sc     upstream.Scenario
	up     *upstream.Upstream
	tier   *cluster.Tier
	listen string // web's listener on the Envoys
}

func startRealEnvoyWorld(t *testing.T, ctx context.Context, backends ...string) *realEnvoyWorld {
	t.Helper()
	return startRealEnvoyWorldWith(t, ctx, cluster.TierConfig{}, backends...)
}

// startRealEnvoyWorldWith is startRealEnvoyWorld with the tier's
// configuration tc (its Upstream is set here; Relays defaults to 3).
func startRealEnvoyWorldWith(t *testing.T, ctx context.Context, tc cluster.TierConfig, backends ...string) *realEnvoyWorld {
	t.Helper()
	w := &realEnvoyWorld{listen: freeLoopbackAddr(t)}
	w.sc = upstream.Scenario{Services: 6, Endpoints: 6, Namespaces: 2, LocalFraction: 0.3,
		HTTPServices: []upstream.HTTPService{{Name: "web", Listen: w.listen, Backends: backends}}}
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario = w.sc
	w.up = startTestUpstream(t, ctx, ucfg)
	if tc.Relays == 0 {
		tc.Relays = 3
	}
	tc.Upstream = w.up.Addr()
	tier, err := cluster.StartConvergedTier(ctx, tc, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tier.Stop(context.Background()) })
	w.tier = tier
	return w
}

// startEnvoy starts a real Envoy for pod (ns, 0, pod) on the tier's
// Service, stopped at cleanup.
func (w *realEnvoyWorld) startEnvoy(t *testing.T, ctx context.Context, bin string, delta bool, ns, pod int) *realenvoy.Envoy {
	t.Helper()
	e, err := realenvoy.Start(ctx, realenvoy.Config{Binary: bin, XDS: w.tier.Addr(), Delta: delta, Node: w.sc.Node(ns, 0, pod), Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("envoy log: %s", e.LogTail(30))
		}
		e.Stop()
	})
	return e
}

// TestRealEnvoyFullSync: a real Envoy bootstraps to the tier and ends with
// exactly the upstream's config for its namespace, resource by resource,
// which is also what the tier says it sent that node (relayctl
// proxy-config's answer); a request through its listener reaches the
// backend.
func TestRealEnvoyFullSync(t *testing.T) {
	bin := install.EnvoyBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	w := startRealEnvoyWorld(t, ctx, httpBackend(t, "backend-a"))
	eachProtocol(t, ctx, func(t *testing.T, ctx context.Context, i int, p protocol) {
		node := w.sc.Node(i, 0, 0) // one namespace per protocol: two keys
		e := w.startEnvoy(t, ctx, bin, p.delta, i, 0)
		want := w.up.Snapshot(w.sc.Group(node))
		got := waitEnvoyHolds(t, ctx, e, want)

		// The tier's own account of what it sent the node.
		dump, _, err := w.tier.Running()[0].Node.Relay().TierConfigDump(ctx, &inspectpb.ConfigDumpRequest{Node: node.GetId()})
		if err != nil {
			t.Fatal(err)
		}
		cd := &adminv3.ConfigDump{}
		if err := dump.GetConfigDump().UnmarshalTo(cd); err != nil {
			t.Fatal(err)
		}
		sent, err := realenvoy.Dynamic(cd)
		if err != nil {
			t.Fatal(err)
		}
		for typeURL, res := range got {
			if len(sent[typeURL]) != len(res) {
				t.Errorf("%s: the tier says it sent %d, envoy holds %d", typeURL, len(sent[typeURL]), len(res))
			}
			for name, r := range res {
				if s, ok := sent[typeURL][name]; !ok || !sameResource(s.Message, r.Message) {
					t.Errorf("%s %s: envoy holds what the tier says it did not send", typeURL, name)
				}
			}
		}
		if body, err := getThrough(ctx, w.listen); err != nil || body != "backend-a" {
			t.Errorf("GET through envoy: %q, %v; want backend-a", body, err)
		}
	})
}

// TestRealEnvoyOverTLSWithJWT: real Envoys dial a secure tier as
// istio-agent has them dial istiod's 15012: TLS checked against the mesh
// root and the relays' Service name, their service-account token as
// "authorization: Bearer" on the stream. The Envoy whose token is of its
// own namespace and service account syncs fully; one presenting another
// namespace's token is refused before anything is served.
func TestRealEnvoyOverTLSWithJWT(t *testing.T) {
	bin := install.EnvoyBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	m := newTestMesh(t, ctx)
	w := startRealEnvoyWorldWith(t, ctx, cluster.TierConfig{Secure: m.security(false)}, httpBackend(t, "backend-a"))
	eachProtocol(t, ctx, func(t *testing.T, ctx context.Context, i int, p protocol) {
		node := w.sc.Node(i, 0, 0)
		ns := upstream.NamespaceName(i)
		sa := node.GetMetadata().GetFields()["SERVICE_ACCOUNT"].GetStringValue()
		start := func(pod int, tokenNS string) *realenvoy.Envoy {
			e, err := realenvoy.Start(ctx, realenvoy.Config{
				Binary: bin, XDS: w.tier.Addr(), Delta: p.delta, Node: w.sc.Node(i, 0, pod), Dir: t.TempDir(),
				TLS: &realenvoy.TLS{CAFile: m.root, ServerName: relayServerName,
					Token: m.issuer.Sign(t, authtest.Token{Namespace: tokenNS, ServiceAccount: sa})},
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(e.Stop)
			return e
		}
		mismatchesBefore := tierCounter(t, w.tier, "meshrelay_xds_auth_failures_total", "identity_mismatch")
		intruder := start(1, "ns-other")
		good := start(0, ns)
		waitEnvoyHolds(t, ctx, good, w.up.Snapshot(w.sc.Group(node)))
		if body, err := getThrough(ctx, w.listen); err != nil || body != "backend-a" {
			t.Errorf("GET through the TLS envoy: %q, %v; want backend-a", body, err)
		}

		// The intruder is refused for the mismatch of its node and its
		// token, holds nothing, and no relay lists it.
		for mismatches := 0; mismatches <= mismatchesBefore; {
			mismatches = tierCounter(t, w.tier, "meshrelay_xds_auth_failures_total", "identity_mismatch")
			select {
			case <-ctx.Done():
				t.Fatal("the Envoy with another namespace's token was never refused for it")
			case <-time.After(20 * time.Millisecond):
			}
		}
		dump, err := intruder.ConfigDump(ctx)
		if err != nil {
			t.Fatal(err)
		}
		held, err := realenvoy.Dynamic(dump)
		if err != nil {
			t.Fatal(err)
		}
		for typeURL, res := range held {
			if len(res) > 0 {
				t.Errorf("an Envoy with another namespace's token holds %d of %s", len(res), typeURL)
			}
		}
		intruderID := w.sc.Node(i, 0, 1).GetId()
		for _, tr := range w.tier.Running() {
			for _, c := range tr.Node.Relay().Clients() {
				if c.NodeID == intruderID {
					t.Errorf("%s serves the Envoy with another namespace's token", tr.ID)
				}
			}
		}
	})
}

// TestRealEnvoyChangesUnderTraffic: under a steady stream of requests
// through a real Envoy, an endpoint move, and a route change to a cluster
// added for it (the old one removed after), each take effect with no
// request failing: make-before-break as a real Envoy sees it. A request
// that fails must fall in the window where the order is wrong, which the
// requests one after another fill but cannot be sure to hit; the
// deterministic guards of the order are the conformance case ("a route to
// a new cluster waits for the cluster's endpoints") and the simulated
// Envoy's ordering rule.
func TestRealEnvoyChangesUnderTraffic(t *testing.T) {
	bin := install.EnvoyBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	a, b, c := httpBackend(t, "backend-a"), httpBackend(t, "backend-b"), httpBackend(t, "backend-c")
	w := startRealEnvoyWorld(t, ctx, a)
	eachProtocol(t, ctx, func(t *testing.T, ctx context.Context, i int, p protocol) {
		if _, err := w.up.SetHTTPBackends("web", []string{a}); err != nil {
			t.Fatal(err)
		}
		node := w.sc.Node(i, 0, 0)
		e := w.startEnvoy(t, ctx, bin, p.delta, i, 0)
		waitEnvoyHolds(t, ctx, e, w.up.Snapshot(w.sc.Group(node)))
		load := startLoad(t, ctx, w.listen)

		if _, err := w.up.SetHTTPBackends("web", []string{b}); err != nil {
			t.Fatal(err)
		}
		waitEnvoyHolds(t, ctx, e, w.up.Snapshot(w.sc.Group(node)))
		load.waitFor(t, ctx, "backend-b")

		if _, err := w.up.SwitchHTTPCluster("web", []string{c}); err != nil {
			t.Fatal(err)
		}
		waitEnvoyHolds(t, ctx, e, w.up.Snapshot(w.sc.Group(node)))
		load.waitFor(t, ctx, "backend-c")

		sent, failed := load.stop()
		t.Logf("%d requests, %d failed", sent, len(failed))
		if len(failed) > 0 {
			t.Errorf("%d of %d requests failed during the changes: %s", len(failed), sent, strings.Join(failed, "; "))
			if st, err := e.Stats(ctx); err == nil {
				for k, v := range st {
					if v != "0" && (strings.Contains(k, "no_cluster") || strings.Contains(k, "none_healthy") || strings.Contains(k, "no_route") || strings.Contains(k, "rq_503") || strings.Contains(k, "rq_5xx") || strings.Contains(k, "downstream_rq_5xx")) {
						t.Logf("stat %s: %s", k, v)
					}
				}
			}
		}
	})
}

// TestRealEnvoyNACK: a cluster Envoy 1.40 rejects (ORIGINAL_DST with
// ROUND_ROBIN, an invalid combination) reaches one namespace's Envoy,
// which NACKs it with Envoy's own error_detail; the tier's ledger (what
// relayctl proxy-status shows) has that Envoy NACKED with the error's
// fingerprint, the Envoy of another namespace is unaffected, and the fixed
// cluster is ACKed.
func TestRealEnvoyNACK(t *testing.T) {
	bin := install.EnvoyBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	w := startRealEnvoyWorld(t, ctx, httpBackend(t, "backend-a"))
	eachProtocol(t, ctx, func(t *testing.T, ctx context.Context, i int, p protocol) {
		bad, other := w.sc.Node(0, 0, i), w.sc.Node(1, 0, i)
		eBad := w.startEnvoy(t, ctx, bin, p.delta, 0, i)
		eOther := w.startEnvoy(t, ctx, bin, p.delta, 1, i)
		waitEnvoyHolds(t, ctx, eBad, w.up.Snapshot(w.sc.Group(bad)))
		waitEnvoyHolds(t, ctx, eOther, w.up.Snapshot(w.sc.Group(other)))

		name := "original-dst-" + p.name
		c := &clusterv3.Cluster{
			Name:                 name,
			ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_ORIGINAL_DST},
			LbPolicy:             clusterv3.Cluster_ROUND_ROBIN,
			ConnectTimeout:       durationpb.New(time.Second),
		}
		if _, err := w.up.PublishCluster(w.sc.Group(bad), c); err != nil {
			t.Fatal(err)
		}
		nack := waitLedger(t, ctx, w.tier, bad.GetId(), resource.ClusterType, ledger.StatusNACKed)
		if !strings.Contains(nack.NACK.Detail, "ORIGINAL_DST") {
			t.Errorf("NACK detail %q is not Envoy's complaint about ORIGINAL_DST", nack.NACK.Detail)
		}
		if nack.NACK.Fingerprint == "" {
			t.Error("NACK without a fingerprint")
		}
		st, err := eBad.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st["cluster_manager.cds.update_rejected"] == "0" || st["cluster_manager.cds.update_rejected"] == "" {
			t.Errorf("envoy's cds.update_rejected = %q, want it counted", st["cluster_manager.cds.update_rejected"])
		}
		waitLedger(t, ctx, w.tier, other.GetId(), resource.ClusterType, ledger.StatusSynced)
		waitEnvoyHolds(t, ctx, eOther, w.up.Snapshot(w.sc.Group(other)))

		c.LbPolicy = clusterv3.Cluster_CLUSTER_PROVIDED
		if _, err := w.up.PublishCluster(w.sc.Group(bad), c); err != nil {
			t.Fatal(err)
		}
		waitLedger(t, ctx, w.tier, bad.GetId(), resource.ClusterType, ledger.StatusSynced)
		waitEnvoyHolds(t, ctx, eBad, w.up.Snapshot(w.sc.Group(bad)))
	})
}

// TestRealEnvoyFailover: under traffic, the owner of a real Envoy's key is
// killed, then the relay the Envoy is connected to: the Envoy reconnects
// through the Service, no request fails, it ends on the current config
// (a change made after both kills reaches it), and its
// control_plane.identifier names the relay it is on now.
func TestRealEnvoyFailover(t *testing.T) {
	bin := install.EnvoyBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	a, b := httpBackend(t, "backend-a"), httpBackend(t, "backend-b")
	eachProtocol(t, ctx, func(t *testing.T, ctx context.Context, i int, p protocol) {
		w := startRealEnvoyWorld(t, ctx, a) // a tier of its own: this one loses two relays
		node := w.sc.Node(i, 0, 0)
		e := w.startEnvoy(t, ctx, bin, p.delta, i, 0)
		waitEnvoyHolds(t, ctx, e, w.up.Snapshot(w.sc.Group(node)))
		load := startLoad(t, ctx, w.listen)
		load.waitFor(t, ctx, "backend-a")

		on, key := waitConnected(t, ctx, w.tier, node.GetId(), -1)
		owner := ownerOf(t, w.tier, string(key))
		t.Logf("envoy on relay-%d, key %s owned by relay-%d", on, key, owner)
		if err := w.tier.StopRelay(ctx, owner, false); err != nil {
			t.Fatal(err)
		}
		if on == owner {
			on, _ = waitConnected(t, ctx, w.tier, node.GetId(), owner)
		}
		if err := w.tier.StopRelay(ctx, on, false); err != nil {
			t.Fatal(err)
		}
		now, _ := waitConnected(t, ctx, w.tier, node.GetId(), on)

		if _, err := w.up.SetHTTPBackends("web", []string{b}); err != nil {
			t.Fatal(err)
		}
		waitEnvoyHolds(t, ctx, e, w.up.Snapshot(w.sc.Group(node)))
		load.waitFor(t, ctx, "backend-b")
		sent, failed := load.stop()
		t.Logf("%d requests, %d failed; envoy ends on relay-%d", sent, len(failed), now)
		if len(failed) > 0 {
			t.Errorf("%d of %d requests failed through the failovers: %s", len(failed), sent, strings.Join(failed, "; "))
		}
		st, err := e.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if id := st["control_plane.identifier"]; id != w.tier.Relay(now).ID {
			t.Errorf("envoy's control_plane.identifier = %q, want %q", id, w.tier.Relay(now).ID)
		}
	})
}

// TestRealEnvoyWarmRestart: a tier restarted from etcd while the upstream
// is down serves a newly started real Envoy its full config (it can only
// have come from etcd), and traffic through it reaches the backend.
func TestRealEnvoyWarmRestart(t *testing.T) {
	bin := install.EnvoyBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	etcd, err := snapshot.StartEmbedded(ctx, snapshot.EmbeddedConfig{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer etcd.Close()
	a := httpBackend(t, "backend-a")
	eachProtocol(t, ctx, func(t *testing.T, ctx context.Context, i int, p protocol) {
		w := startRealEnvoyWorldWith(t, ctx, cluster.TierConfig{Etcd: etcd.Endpoints()}, a)
		node := w.sc.Node(i, 0, 0)
		first := w.startEnvoy(t, ctx, bin, p.delta, i, 0)
		want := w.up.Snapshot(w.sc.Group(node))
		waitEnvoyHolds(t, ctx, first, want)
		first.Stop()

		// Every relay stops gracefully (writing what its store holds),
		// then the upstream goes away for good.
		var wg sync.WaitGroup
		for _, tr := range w.tier.Running() {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := w.tier.StopRelay(ctx, tr.Index, true); err != nil {
					t.Errorf("stop relay-%d: %v", tr.Index, err)
				}
			}()
		}
		wg.Wait()
		w.tier.Stop(ctx)
		if err := w.up.Stop(ctx); err != nil {
			t.Fatal(err)
		}

		tier, err := cluster.StartConvergedTier(ctx, cluster.TierConfig{Relays: 3, Upstream: w.up.Addr(), Etcd: etcd.Endpoints()}, 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer tier.Stop(context.Background())
		w.tier = tier
		second := w.startEnvoy(t, ctx, bin, p.delta, i, 1) // another pod of the same workload: the same key
		waitEnvoyHolds(t, ctx, second, want)
		if body, err := getThrough(ctx, w.listen); err != nil || body != "backend-a" {
			t.Errorf("GET through the warm-started envoy: %q, %v; want backend-a", body, err)
		}
	})
}

// TestRealEnvoyReconnectSendsNothingUnchanged: a real Envoy reconnects
// to its relay after the relay restarted, declaring what it holds (Delta
// initial_resource_versions, SotW version_info); nothing changed upstream,
// so the restarted relay sends it no resource again. Its counters (the
// relay has no other client) show it: no resource or removal sent, and
// for Delta only the empty answers to the wildcard types, which name the
// relay to the Envoy (control_plane.identifier); SotW gets nothing at all,
// since a SotW answer would carry every resource of the type again.
func TestRealEnvoyReconnectSendsNothingUnchanged(t *testing.T) {
	bin := install.EnvoyBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	a := httpBackend(t, "backend-a")
	for i, p := range protocols {
		// The simulated Envoy must be sent the same: it is what the
		// benchmarks count.
		for _, simulated := range []bool{false, true} {
			name := p.name
			if simulated {
				name = "simulated-" + p.name
			}
			t.Run(name, func(t *testing.T) {
				ctx, cancel := context.WithTimeout(ctx, time.Minute)
				defer cancel()
				w := startRealEnvoyWorldWith(t, ctx, cluster.TierConfig{Relays: 1}, a)
				node := w.sc.Node(i, 0, 0)
				var e *realenvoy.Envoy
				if simulated {
					proto := envoy.SotW
					if p.delta {
						proto = envoy.Delta
					}
					// Envoy 0 of a fleet of one key is pod 0 of ns-0.
					node = w.sc.Node(0, 0, 0)
					fleet, err := traffic.StartFleet(ctx, traffic.FleetConfig{Scenario: w.sc, Envoys: 1, Keys: 1, Protocol: proto, Target: w.tier.Addr()})
					if err != nil {
						t.Fatal(err)
					}
					defer fleet.Stop(context.Background())
					if err := fleet.WaitSynced(ctx, w.up); err != nil {
						t.Fatal(err)
					}
				} else {
					e = w.startEnvoy(t, ctx, bin, p.delta, i, 0)
					waitEnvoyHolds(t, ctx, e, w.up.Snapshot(w.sc.Group(node)))
				}
				// Synced as the relay sees it too (the fleet's own check
				// passes on what it has subscribed to so far), so that no
				// response of the first sync is still to come.
				for _, typeURL := range []string{resource.ClusterType, resource.EndpointType, resource.ListenerType, resource.RouteType} {
					waitLedger(t, ctx, w.tier, node.GetId(), typeURL, ledger.StatusSynced)
				}
				full := pushCounters(t, w.tier.Relay(0))

				if err := w.tier.StopRelay(ctx, 0, false); err != nil {
					t.Fatal(err)
				}
				if err := w.tier.Start(ctx, 0); err != nil {
					t.Fatal(err)
				}
				waitConnected(t, ctx, w.tier, node.GetId(), -1)
				for _, typeURL := range []string{resource.ClusterType, resource.EndpointType, resource.ListenerType, resource.RouteType} {
					waitLedger(t, ctx, w.tier, node.GetId(), typeURL, ledger.StatusSynced)
				}
				again := pushCounters(t, w.tier.Relay(0))
				t.Logf("full sync: %+v; after the relay restarted: %+v", full, again)
				if again.resources != 0 {
					t.Errorf("the restarted relay sent %d resources or removals to an Envoy that held everything", again.resources)
				}
				want := 0
				if p.delta {
					want = 2 // CDS and LDS, empty
				}
				if again.responses != want {
					t.Errorf("the restarted relay sent %d responses (%d bytes), want %d", again.responses, again.bytes, want)
				}
				if e == nil {
					return
				}
				waitEnvoyHolds(t, ctx, e, w.up.Snapshot(w.sc.Group(node)))
				if p.delta {
					st, err := e.Stats(ctx)
					if err != nil {
						t.Fatal(err)
					}
					if id := st["control_plane.identifier"]; id != w.tier.Relay(0).ID {
						t.Errorf("control_plane.identifier = %q, want %q", id, w.tier.Relay(0).ID)
					}
				}
			})
		}
	}
}

// counterOf returns the value of counter name of tr's metrics, summed over
// the series with a label of value label ("" for all).
func counterOf(t *testing.T, tr *cluster.TierRelay, name, label string) int {
	t.Helper()
	mfs, err := tr.Node.Relay().Gatherer().Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if label == "" || slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetValue() == label }) {
				n += int(m.GetCounter().GetValue())
			}
		}
	}
	return n
}

// tierCounter is counterOf summed over the tier's running relays.
func tierCounter(t *testing.T, tier *cluster.Tier, name, label string) int {
	t.Helper()
	n := 0
	for _, tr := range tier.Running() {
		n += counterOf(t, tr, name, label)
	}
	return n
}

// pushes are a relay's counters of what it sent downstream.
type pushes struct{ responses, resources, bytes int }

func pushCounters(t *testing.T, tr *cluster.TierRelay) pushes {
	t.Helper()
	p := pushes{
		responses: counterOf(t, tr, "meshrelay_xds_pushes_total", ""),
		resources: counterOf(t, tr, "meshrelay_xds_push_resources_total", ""),
		bytes:     counterOf(t, tr, "meshrelay_xds_push_bytes_total", ""),
	}
	if st := tr.Node.Relay().Stats(); int(st.BytesSent) != p.bytes {
		t.Fatalf("the relay's sent-bytes counter says %d, its metrics %d", st.BytesSent, p.bytes)
	}
	return p
}

// waitConnected waits until node's stream is attached to a running relay
// other than not (-1: any), and returns its index and the node's key.
func waitConnected(t *testing.T, ctx context.Context, tier *cluster.Tier, node string, not int) (int, aggkey.Key) {
	t.Helper()
	for {
		for _, tr := range tier.Running() {
			if tr.Index == not {
				continue
			}
			for _, c := range tr.Node.Relay().Clients() {
				if c.NodeID == node && c.PeerRelay == "" {
					return tr.Index, c.Key
				}
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s never attached to a relay other than %d", node, not)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// ownerOf returns the index of the running relay that owns key.
func ownerOf(t *testing.T, tier *cluster.Tier, key string) int {
	t.Helper()
	for _, tr := range tier.Running() {
		if _, self := tr.Node.Ring().Owner(key); self {
			return tr.Index
		}
	}
	t.Fatalf("no running relay owns %s", key)
	return -1
}

// waitLedger waits until the tier's ledger has node's typeURL in status,
// and returns that type's state.
func waitLedger(t *testing.T, ctx context.Context, tier *cluster.Tier, node, typeURL string, status ledger.SyncStatus) ledger.EnvoyType {
	t.Helper()
	var last ledger.SyncStatus
	for {
		rep := tier.Running()[0].Node.Relay().TierLedger(ctx, ledger.Scope{}, ledger.Full)
		for _, e := range rep.Envoys() {
			if e.State.Node != node || !e.State.Connected() {
				continue
			}
			for _, et := range e.State.Types {
				if et.Type == typeURL {
					if last = rep.Status(e, et); last == status {
						return et
					}
				}
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s's %s never %s in the tier's ledger (last %q)", node, typeURL, status, last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// load sends GETs through an Envoy listener one after another until stop,
// at most maxLoadRequests, and records the failures.
type load struct {
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once

	mu     sync.Mutex
	sent   int
	failed []string
	last   string // the body of the latest answer
}

const maxLoadRequests = 200_000

func startLoad(t *testing.T, ctx context.Context, addr string) *load {
	ctx, cancel := context.WithCancel(ctx)
	l := &load{cancel: cancel, done: make(chan struct{})}
	t.Cleanup(func() { l.stop() }) // also when the test fails before its own stop
	go func() {
		defer close(l.done)
		for n := 0; n < maxLoadRequests && ctx.Err() == nil; n++ {
			body, err := getThrough(ctx, addr)
			if ctx.Err() != nil {
				return // stopped mid-request: not the Envoy's failure
			}
			l.mu.Lock()
			l.sent++
			if err != nil {
				l.failed = append(l.failed, fmt.Sprintf("%v after %q (%q)", err, l.last, body))
			} else {
				l.last = body
			}
			l.mu.Unlock()
		}
	}()
	return l
}

// waitFor waits until the latest answer came from backend.
func (l *load) waitFor(t *testing.T, ctx context.Context, backend string) {
	t.Helper()
	for {
		l.mu.Lock()
		last := l.last
		l.mu.Unlock()
		if last == backend {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("requests never reached %s (latest answer from %q)", backend, last)
		case <-l.done:
			t.Fatalf("the load ended before requests reached %s", backend)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// stop ends the load and returns how many requests were sent and the
// failures.
func (l *load) stop() (int, []string) {
	l.once.Do(l.cancel)
	<-l.done
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.sent, l.failed
}

// waitEnvoyHolds waits until e's dynamic config is want exactly (every type
// of want, each resource proto-equal), and returns it.
func waitEnvoyHolds(t *testing.T, ctx context.Context, e *realenvoy.Envoy, want map[string]map[string]proto.Message) map[string]map[string]realenvoy.Resource {
	t.Helper()
	var diff string
	for {
		dump, err := e.ConfigDump(ctx)
		if err != nil {
			t.Fatal(err)
		}
		got, err := realenvoy.Dynamic(dump)
		if err != nil {
			t.Fatal(err)
		}
		if diff = configDiff(got, want); diff == "" {
			return got
		}
		select {
		case <-ctx.Done():
			t.Fatalf("envoy never held the upstream's config: %s", diff)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// configDiff describes how got differs from want ("" if it does not).
func configDiff(got map[string]map[string]realenvoy.Resource, want map[string]map[string]proto.Message) string {
	var d []string
	for typeURL, res := range want {
		for name, m := range res {
			g, ok := got[typeURL][name]
			switch {
			case !ok:
				d = append(d, "lacks "+typeURL+" "+name)
			case !sameResource(g.Message, m):
				d = append(d, "differs "+typeURL+" "+name)
			}
		}
		for name := range got[typeURL] {
			if _, ok := res[name]; !ok {
				d = append(d, "extra "+typeURL+" "+name)
			}
		}
	}
	if len(d) > 5 {
		d = append(d[:5], fmt.Sprintf("and %d more", len(d)-5))
	}
	return strings.Join(d, "; ")
}

// sameResource reports whether a and b are the same resource as Envoy
// uses it. Envoy's config dump rebuilds a ClusterLoadAssignment from the
// hosts it made of it: locality metadata is gone, the default policy and
// an empty health check config are filled in. Those are left out of the
// comparison; everything else, the endpoints' own metadata included, must
// be equal.
func sameResource(a, b proto.Message) bool {
	return proto.Equal(asEnvoyUses(a), asEnvoyUses(b))
}

func asEnvoyUses(m proto.Message) proto.Message {
	cla, ok := m.(*endpointv3.ClusterLoadAssignment)
	if !ok {
		return m
	}
	cla = proto.Clone(cla).(*endpointv3.ClusterLoadAssignment)
	cla.Policy = nil
	for _, loc := range cla.GetEndpoints() {
		loc.Metadata = nil
		for _, lb := range loc.GetLbEndpoints() {
			if ep := lb.GetEndpoint(); ep != nil && proto.Size(ep.GetHealthCheckConfig()) == 0 {
				ep.HealthCheckConfig = nil
			}
		}
	}
	return cla
}

// httpBackend serves name as the body of every request on loopback, until
// the test ends.
func httpBackend(t *testing.T, name string) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, name) })}
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Close() })
	return lis.Addr().String()
}

// freeLoopbackAddr returns a loopback address no one listens on now.
func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	// An address of its own in 127.0.0.0/8, not 127.0.0.1: the port is
	// free only until the listener below closes, and on 127.0.0.1 another
	// test's outgoing connection may take it as its local port meanwhile
	// (a run under load saw Envoy's bind fail so).
	ip := fmt.Sprintf("127.%d.%d.%d", 1+mrand.IntN(254), mrand.IntN(256), 1+mrand.IntN(254))
	lis, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	return lis.Addr().String()
}

// getThrough sends one GET to addr (an Envoy listener) and returns the body,
// or an error for anything but a 200.
func getThrough(ctx context.Context, addr string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/", nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return string(b), fmt.Errorf("status %d", resp.StatusCode)
	}
	return string(b), nil
}
