package envoy

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpoint "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/types/known/anypb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

var protocols = []Protocol{SotW, Delta}

// matrix runs f for every protocol and upstream cache.
func matrix(t *testing.T, f func(t *testing.T, p Protocol, kind string)) {
	for _, p := range protocols {
		for _, kind := range cacheKinds {
			t.Run(p.String()+"/"+kind, func(t *testing.T) {
				t.Parallel()
				f(t, p, kind)
			})
		}
	}
}

func TestNewValidates(t *testing.T) {
	good := DefaultConfig()
	good.Node = &core.Node{Id: testNodeID}
	good.Conn = newFailingConn()
	tests := []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"ok", func(*Config) {}, ""},
		{"no node", func(c *Config) { c.Node = nil }, "envoy: field Node"},
		{"empty node id", func(c *Config) { c.Node = &core.Node{} }, "envoy: field Node"},
		{"no conn", func(c *Config) { c.Conn = nil }, "envoy: field Conn"},
		{"bad protocol", func(c *Config) { c.Protocol = 7 }, "envoy: field Protocol"},
		{"zero backoff", func(c *Config) { c.Backoff = Backoff{} }, "envoy: field Backoff"},
		{"max below base", func(c *Config) { c.Backoff = Backoff{Base: time.Second, Max: time.Millisecond} }, "envoy: field Backoff"},
		{"negative read delay", func(c *Config) { c.ReadDelay = -1 }, "envoy: field ReadDelay"},
		{"negative grace", func(c *Config) { c.UnsubscribeGrace = -1 }, "envoy: field UnsubscribeGrace"},
		{"zero recv size", func(c *Config) { c.MaxRecvMsgSize = 0 }, "envoy: field MaxRecvMsgSize"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := good
			tt.edit(&cfg)
			_, err := New(cfg)
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("New() = %v, want nil", err)
			case tt.want != "" && (err == nil || !strings.HasPrefix(err.Error(), tt.want)):
				t.Fatalf("New() = %v, want an error starting with %q", err, tt.want)
			}
		})
	}
}

func TestProtocolString(t *testing.T) {
	for p, want := range map[Protocol]string{SotW: "sotw", Delta: "delta", 9: "Protocol(9)"} {
		if got := p.String(); got != want {
			t.Errorf("Protocol(%d).String() = %q, want %q", int(p), got, want)
		}
	}
}

func TestInitialSync(t *testing.T) {
	matrix(t, func(t *testing.T, p Protocol, kind string) {
		w := baseWorld()
		u := newUpstream(t, kind, w)
		var mu sync.Mutex
		var events []Event
		e := newTestEnvoy(t, u.conn, p, func(c *Config) {
			c.OnEvent = func(ev Event) {
				mu.Lock()
				events = append(events, ev)
				mu.Unlock()
			}
		})
		waitFor(t, e, "initial sync", synced(w))
		noViolations(t, e)

		if got, want := e.Subscribed(EndpointType), []string{"c1", "c2"}; !slices.Equal(got, want) {
			t.Errorf("Subscribed(EDS) = %q, want %q", got, want)
		}
		if got, want := e.Subscribed(RouteType), []string{"r1"}; !slices.Equal(got, want) {
			t.Errorf("Subscribed(RDS) = %q, want %q", got, want)
		}
		st := e.Stats()
		if st.NACKs != 0 || st.ACKs < 4 || st.ACKs != st.Responses || !st.Connected || st.BytesReceived == 0 {
			t.Errorf("Stats() = %+v, want >= 4 responses, all ACKed, connected", st)
		}
		if p == SotW && kind == "snapshot" {
			if got, want := e.Version(ClusterType), u.snapshotVersion(); got != want {
				t.Errorf("Version(CDS) = %q, want %q", got, want)
			}
		}

		// Envoy's order: CDS first, LDS only after the first CDS response.
		u.rec.mu.Lock()
		var order []string
		if p == SotW {
			for _, r := range u.rec.sotw {
				order = append(order, short(r.req.GetTypeUrl())+":"+r.req.GetResponseNonce())
			}
		} else {
			for _, r := range u.rec.delta {
				order = append(order, short(r.req.GetTypeUrl())+":"+r.req.GetResponseNonce())
			}
		}
		u.rec.mu.Unlock()
		if len(order) == 0 || order[0] != "Cluster:" {
			t.Fatalf("first request = %v, want a CDS request without nonce", order)
		}
		lds := slices.Index(order, "Listener:")
		cdsAck := slices.IndexFunc(order, func(s string) bool { return strings.HasPrefix(s, "Cluster:") && s != "Cluster:" })
		if lds < 0 || cdsAck < 0 || lds < cdsAck {
			t.Errorf("requests %v: want the first LDS request after the CDS ACK", order)
		}

		// Every response was received then ACKed, with the same nonce.
		mu.Lock()
		defer mu.Unlock()
		received := map[string]bool{}
		for _, ev := range events {
			switch ev.Kind {
			case Received:
				received[ev.Nonce] = true
			case ACKed:
				if !received[ev.Nonce] {
					t.Errorf("ACK event for nonce %q before its Received event", ev.Nonce)
				}
			case NACKed:
				t.Errorf("unexpected NACK event %+v", ev)
			}
		}
	})
}

func TestUpdateOneLoadAssignment(t *testing.T) {
	matrix(t, func(t *testing.T, p Protocol, kind string) {
		w := baseWorld()
		u := newUpstream(t, kind, w)
		e := newTestEnvoy(t, u.conn, p, nil)
		waitFor(t, e, "initial sync", synced(w))
		before := e.Resources(EndpointType)["c2"]

		w2 := w.clone()
		w2.clusters["c1"] = 9001
		u.set(w2)
		waitFor(t, e, "c1 on port 9001", func(v View) bool {
			h, ok := v.Get(EndpointType, "c1")
			return ok && portOf(t, h) == 9001
		})
		// A SotW EDS response may carry only c1: c2 must still be held.
		after, ok := e.Resources(EndpointType)["c2"]
		if !ok {
			t.Fatalf("c2 dropped by an update of c1")
		}
		if portOf(t, after) != 8002 || (p == Delta && after.Version != before.Version) {
			t.Errorf("c2 = %+v, want unchanged %+v", after, before)
		}
		noViolations(t, e)
	})
}

func TestRemoveCluster(t *testing.T) {
	matrix(t, func(t *testing.T, p Protocol, kind string) {
		w := baseWorld()
		u := newUpstream(t, kind, w)
		var mu sync.Mutex
		var removed []string
		e := newTestEnvoy(t, u.conn, p, func(c *Config) {
			c.OnEvent = func(ev Event) {
				if ev.Kind == Removed {
					mu.Lock()
					for _, n := range ev.Names {
						removed = append(removed, short(ev.TypeURL)+"/"+n)
					}
					mu.Unlock()
				}
			}
		})
		waitFor(t, e, "initial sync", synced(w))

		w2 := w.clone()
		delete(w2.clusters, "c2")
		u.set(w2)
		waitFor(t, e, "c2 removed", synced(w2))
		if got, want := e.Subscribed(EndpointType), []string{"c1"}; !slices.Equal(got, want) {
			t.Errorf("Subscribed(EDS) = %q, want %q", got, want)
		}
		// The upstream saw EDS unsubscribed from c2.
		u.rec.waitFor(t, "an EDS request without c2", func(r *recorder) bool {
			if p == SotW {
				for _, x := range r.sotw {
					if x.req.GetTypeUrl() == EndpointType && slices.Equal(x.req.GetResourceNames(), []string{"c1"}) {
						return true
					}
				}
				return false
			}
			for _, x := range r.delta {
				if x.req.GetTypeUrl() == EndpointType && slices.Contains(x.req.GetResourceNamesUnsubscribe(), "c2") {
					return true
				}
			}
			return false
		})
		mu.Lock()
		slices.Sort(removed)
		got := slices.Compact(removed)
		mu.Unlock()
		if want := []string{"Cluster/c2", "ClusterLoadAssignment/c2"}; !slices.Equal(got, want) {
			t.Errorf("Removed events = %q, want %q", got, want)
		}
		noViolations(t, e)
	})
}

var errBadPort = errors.New("port 9999 is not allowed")

// rejectPort9999 NACKs any EDS response with an endpoint on port 9999.
func rejectPort9999(typeURL string, res []*anypb.Any) error {
	if typeURL != EndpointType {
		return nil
	}
	for _, a := range res {
		var c endpoint.ClusterLoadAssignment
		if err := a.UnmarshalTo(&c); err != nil {
			return err
		}
		for _, l := range c.GetEndpoints() {
			for _, ep := range l.GetLbEndpoints() {
				if ep.GetEndpoint().GetAddress().GetSocketAddress().GetPortValue() == 9999 {
					return fmt.Errorf("%s: %w", c.GetClusterName(), errBadPort)
				}
			}
		}
	}
	return nil
}

func TestNACKKeepsState(t *testing.T) {
	matrix(t, func(t *testing.T, p Protocol, kind string) {
		w := baseWorld()
		u := newUpstream(t, kind, w)
		e := newTestEnvoy(t, u.conn, p, func(c *Config) { c.Reject = rejectPort9999 })
		waitFor(t, e, "initial sync", synced(w))
		ackedEDS := e.Version(EndpointType)
		before := e.Resources(EndpointType)["c1"]

		bad := w.clone()
		bad.clusters["c1"] = 9999
		u.set(bad)
		waitFor(t, e, "a NACK", func(v View) bool { return v.Stats().NACKs > 0 })

		// The upstream saw the NACK: error_detail, and in SotW the last
		// ACKed version.
		u.rec.waitFor(t, "a NACK with error_detail", func(r *recorder) bool {
			if p == SotW {
				for _, x := range r.sotw {
					if d := x.req.GetErrorDetail(); d != nil {
						if !strings.Contains(d.GetMessage(), errBadPort.Error()) || x.req.GetVersionInfo() != ackedEDS || x.req.GetResponseNonce() == "" {
							t.Errorf("NACK = %v, want error_detail %q, version_info %q, a nonce", x.req, errBadPort, ackedEDS)
						}
						return true
					}
				}
				return false
			}
			for _, x := range r.delta {
				if d := x.req.GetErrorDetail(); d != nil {
					if !strings.Contains(d.GetMessage(), errBadPort.Error()) || x.req.GetResponseNonce() == "" {
						t.Errorf("NACK = %v, want error_detail %q and a nonce", x.req, errBadPort)
					}
					return true
				}
			}
			return false
		})
		if got := e.Resources(EndpointType)["c1"]; portOf(t, got) != 8001 || got.Version != before.Version {
			t.Errorf("c1 after NACK = port %d version %q, want the old port 8001 version %q", portOf(t, got), got.Version, before.Version)
		}
		if got := e.Version(EndpointType); got != ackedEDS {
			t.Errorf("Version(EDS) after NACK = %q, want %q", got, ackedEDS)
		}

		good := w.clone()
		good.clusters["c1"] = 8003
		u.set(good)
		waitFor(t, e, "c1 on port 8003", func(v View) bool {
			h, ok := v.Get(EndpointType, "c1")
			return ok && portOf(t, h) == 8003
		})
		// go-control-plane #46: the SnapshotCache answers a SotW NACK (which
		// carries the old version) with the same snapshot at once.
		t.Logf("%s/%s: NACKs sent before the fix: %d", p, kind, e.Stats().NACKs)
		noViolations(t, e)
	})
}

func TestReconnectKeepsState(t *testing.T) {
	matrix(t, func(t *testing.T, p Protocol, kind string) {
		w := baseWorld()
		u := newUpstream(t, kind, w)
		e := newTestEnvoy(t, u.conn, p, nil)
		waitFor(t, e, "initial sync", synced(w))
		cdsVersion, edsVersion := e.Version(ClusterType), e.Version(EndpointType)
		held := e.Resources(ClusterType)

		u.stop()
		waitFor(t, e, "disconnected", func(v View) bool { return !v.Stats().Connected })
		if !synced(w)(View{e}) {
			t.Fatalf("state lost on disconnect: %d clusters", len(e.Resources(ClusterType)))
		}
		// istio #41494: a removal while the Envoy is away must reach it.
		w2 := w.clone()
		delete(w2.clusters, "c2")
		u.set(w2)
		u.start()
		waitFor(t, e, "reconnected and c2 removed", func(v View) bool {
			st := v.Stats()
			return st.Connected && st.Reconnects > 0 && synced(w2)(v)
		})
		noViolations(t, e)

		// What the first requests of the new stream carried (the upstream
		// may still be reading them: Envoy-side state converged already).
		if p == SotW {
			var cds, eds *discovery.DiscoveryRequest
			u.rec.waitFor(t, "the new stream's CDS and EDS requests", func(r *recorder) bool {
				cds, eds = nil, nil
				for _, x := range r.sotw {
					if x.epoch != 2 {
						continue
					}
					if cds == nil && x.req.GetTypeUrl() == ClusterType {
						cds = x.req
					}
					if eds == nil && x.req.GetTypeUrl() == EndpointType {
						eds = x.req
					}
				}
				return cds != nil && eds != nil
			})
			if cds.GetVersionInfo() != cdsVersion || cds.GetResponseNonce() != "" || cds.GetNode().GetId() != testNodeID {
				t.Errorf("first CDS request after restart = %v, want version_info %q, no nonce, the node", cds, cdsVersion)
			}
			// (go-control-plane copies the node into every request before its
			// callbacks: TestViolations/clean checks node-on-first-only.)
			if eds.GetVersionInfo() != edsVersion || !slices.Equal(eds.GetResourceNames(), []string{"c1", "c2"}) {
				t.Errorf("first EDS request after restart = %v, want version_info %q, names [c1 c2]", eds, edsVersion)
			}
			return
		}
		var cds, eds *discovery.DeltaDiscoveryRequest
		u.rec.waitFor(t, "the new stream's CDS and EDS requests", func(r *recorder) bool {
			cds, eds = nil, nil
			for _, x := range r.delta {
				if x.epoch != 2 {
					continue
				}
				if cds == nil && x.req.GetTypeUrl() == ClusterType {
					cds = x.req
				}
				if eds == nil && x.req.GetTypeUrl() == EndpointType {
					eds = x.req
				}
			}
			return cds != nil && eds != nil
		})
		if len(cds.GetInitialResourceVersions()) != 2 || cds.GetResponseNonce() != "" || len(cds.GetResourceNamesSubscribe()) != 0 {
			t.Errorf("first CDS request after restart = %v, want a wildcard with initial_resource_versions for c1, c2", cds)
		}
		for n, h := range held {
			if got := cds.GetInitialResourceVersions()[n]; got != h.Version {
				t.Errorf("initial_resource_versions[%q] = %q, want %q", n, got, h.Version)
			}
		}
		if len(eds.GetInitialResourceVersions()) != 2 || !slices.Equal(eds.GetResourceNamesSubscribe(), []string{"c1", "c2"}) {
			t.Errorf("first EDS request after restart = %v, want subscribe [c1 c2] with 2 initial versions", eds)
		}
	})
}

// TestDeclaredOnReconnect: the first request of each type on a new stream
// is reported as a Declared event naming what the Envoy holds (a change it
// applied but could not ACK before the stream broke is known to the server
// from there on), and the first stream declares nothing.
func TestDeclaredOnReconnect(t *testing.T) {
	matrix(t, func(t *testing.T, p Protocol, kind string) {
		w := baseWorld()
		u := newUpstream(t, kind, w)
		var mu sync.Mutex
		declared := map[string][]string{}
		e := newTestEnvoy(t, u.conn, p, func(c *Config) {
			c.OnEvent = func(ev Event) {
				if ev.Kind == Declared {
					mu.Lock()
					declared[ev.TypeURL] = append(declared[ev.TypeURL], ev.Names...)
					mu.Unlock()
				}
			}
		})
		waitFor(t, e, "initial sync", synced(w))
		mu.Lock()
		if len(declared) != 0 {
			t.Fatalf("first stream declared %v, want nothing", declared)
		}
		mu.Unlock()
		u.stop()
		waitFor(t, e, "disconnected", func(v View) bool { return !v.Stats().Connected })
		u.start()
		waitFor(t, e, "reconnected", func(v View) bool { return v.Stats().Connected && v.Stats().Reconnects > 0 && synced(w)(v) })
		deadline := time.Now().Add(10 * time.Second)
		for {
			mu.Lock()
			cds, eds := slices.Sorted(slices.Values(declared[ClusterType])), slices.Sorted(slices.Values(declared[EndpointType]))
			mu.Unlock()
			if slices.Equal(cds, []string{"c1", "c2"}) && slices.Equal(eds, []string{"c1", "c2"}) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("declared CDS %v, EDS %v; want [c1 c2] each", cds, eds)
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

func TestForgetThenSubscribe(t *testing.T) {
	matrix(t, func(t *testing.T, p Protocol, kind string) {
		w := baseWorld()
		u := newUpstream(t, kind, w)
		e := newTestEnvoy(t, u.conn, p, nil)
		waitFor(t, e, "initial sync", synced(w))

		e.Forget(EndpointType, "c1")
		if (View{e}).Has(EndpointType, "c1") {
			t.Fatalf("c1 still held after Forget")
		}
		if got := e.Subscribed(EndpointType); !slices.Equal(got, []string{"c1", "c2"}) {
			t.Fatalf("Subscribed(EDS) after Forget = %q, want [c1 c2]", got)
		}
		u.rec.mu.Lock()
		mark := len(u.rec.sotw) + len(u.rec.delta)
		u.rec.mu.Unlock()

		e.Subscribe(EndpointType, []string{"c1"})
		u.rec.waitFor(t, "c1 named again", func(r *recorder) bool {
			if p == SotW {
				for _, x := range r.sotw[min(mark, len(r.sotw)):] {
					if x.req.GetTypeUrl() == EndpointType && slices.Contains(x.req.GetResourceNames(), "c1") {
						return true
					}
				}
				return false
			}
			for _, x := range r.delta[min(mark, len(r.delta)):] {
				if x.req.GetTypeUrl() == EndpointType && slices.Equal(x.req.GetResourceNamesSubscribe(), []string{"c1"}) {
					return true
				}
			}
			return false
		})
		// Barrier: the upstream answers requests in order, so once s1 (asked
		// after) arrives, any re-send of c1 has arrived too.
		e.Subscribe(secretType, []string{"s1"})
		waitFor(t, e, "secret s1", func(v View) bool { return v.Has(secretType, "s1") })
		t.Logf("%s/%s: upstream re-sent the forgotten c1 when named again: %v", p, kind, (View{e}).Has(EndpointType, "c1"))

		w2 := w.clone()
		w2.clusters["c1"] = 8011
		u.set(w2)
		waitFor(t, e, "c1 back", func(v View) bool {
			h, ok := v.Get(EndpointType, "c1")
			return ok && portOf(t, h) == 8011
		})
		noViolations(t, e)
	})
}

func TestSubscribeUnknownType(t *testing.T) {
	for _, p := range protocols {
		t.Run(p.String(), func(t *testing.T) {
			t.Parallel()
			u := newUpstream(t, "linear", baseWorld())
			e := newTestEnvoy(t, u.conn, p, nil)
			e.Subscribe(nameTable, []string{"nt"})
			waitFor(t, e, "the name table", func(v View) bool { return v.Len(nameTable) == 1 })
			// SotW carries no names: an unregistered type's name is unknown.
			wantName := map[Protocol]string{SotW: "", Delta: "nt"}[p]
			if _, ok := e.Resources(nameTable)[wantName]; !ok {
				t.Errorf("Resources(NameTable) = %v, want one named %q", e.Resources(nameTable), wantName)
			}
			noViolations(t, e)
		})
	}
}

// TestNoACK: an Envoy that never ACKs still applies, and sends no ACK.
func TestNoACK(t *testing.T) {
	for _, p := range protocols {
		t.Run(p.String(), func(t *testing.T) {
			t.Parallel()
			u := newUpstream(t, "snapshot", baseWorld())
			e := newTestEnvoy(t, u.conn, p, func(c *Config) { c.NoACK = true })
			waitFor(t, e, "CDS and EDS", func(v View) bool { return v.Len(ClusterType) == 2 && v.Len(EndpointType) == 2 })
			if st := e.Stats(); st.ACKs != 0 || st.NACKs != 0 {
				t.Errorf("Stats() = %+v, want no ACK nor NACK", st)
			}
			u.rec.mu.Lock()
			defer u.rec.mu.Unlock()
			for _, x := range u.rec.sotw {
				if x.req.GetResponseNonce() != "" && x.req.GetTypeUrl() == ClusterType {
					t.Errorf("SotW CDS request with a nonce (an ACK): %v", x.req)
				}
			}
			for _, x := range u.rec.delta {
				if x.req.GetResponseNonce() != "" {
					t.Errorf("Delta request with a nonce (an ACK): %v", x.req)
				}
			}
		})
	}
}

func TestStopIsIdempotent(t *testing.T) {
	u := newUpstream(t, "snapshot", baseWorld())
	cfg := DefaultConfig()
	cfg.Node = &core.Node{Id: testNodeID}
	cfg.Conn = u.conn
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.Start(ctx); err == nil {
		t.Errorf("second Start() = nil, want an error")
	}
	for i := 0; i < 2; i++ {
		if err := e.Stop(ctx); err != nil {
			t.Errorf("Stop() #%d = %v", i, err)
		}
	}
	if err := e.Start(ctx); !errors.Is(err, ErrStopped) {
		t.Errorf("Start() after Stop = %v, want ErrStopped", err)
	}
	if err := e.WaitFor(ctx, func(View) bool { return false }); !errors.Is(err, ErrStopped) {
		t.Errorf("WaitFor() after Stop = %v, want ErrStopped", err)
	}
}

// short returns the last element of a type URL.
func short(typeURL string) string {
	return typeURL[strings.LastIndex(typeURL, ".")+1:]
}

// TestOrderingFlagsSnapshotCacheRemoval: go-control-plane's SnapshotCache (ADS
// mode) pushes CDS before RDS even when an update removes a cluster together
// with the route that used it, so the cluster goes away while the held route
// still points at it. The checker must catch this real upstream's order; if
// go-control-plane starts removing last, this test fails and can be dropped.
func TestOrderingFlagsSnapshotCacheRemoval(t *testing.T) {
	for _, p := range protocols {
		t.Run(p.String(), func(t *testing.T) {
			t.Parallel()
			w := baseWorld()
			w.routes["r1"] = []string{"c1", "c2"}
			u := newUpstream(t, "snapshot", w)
			e := newTestEnvoy(t, u.conn, p, nil)
			waitFor(t, e, "initial sync", synced(w))
			// Barrier: once s1 (asked last) arrives, the upstream has
			// processed every ACK, so every type has an open watch.
			e.Subscribe(secretType, []string{"s1"})
			waitFor(t, e, "s1", func(v View) bool { return v.Has(secretType, "s1") })

			w2 := w.clone()
			delete(w2.clusters, "c2")
			w2.routes["r1"] = []string{"c1"}
			u.set(w2)
			waitFor(t, e, "an ordering violation", func(v View) bool { return hasRule(v.e.Violations(), RuleOrdering) })
			waitFor(t, e, "the update", synced(w2))
			t.Logf("recorded: %v", e.Violations())
		})
	}
}
