package relay

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"maps"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// meshRequests returns the largest requests an Envoy of a mesh of n
// services (one port each, Istio's cluster names) sends: a Delta
// reconnect declaring every cluster it holds at the relay's versions, and
// a SotW EDS request naming every cluster's endpoints.
func meshRequests(n int) (delta *discovery.DeltaDiscoveryRequest, sotw *discovery.DiscoveryRequest) {
	clock := ledger.NewClock(func() time.Time { return time.Date(2026, 12, 7, 0, 0, 0, 0, time.UTC) })
	session := clock.Now()
	for range 100_000 {
		clock.Now() // an At with as many digits as a long-lived stream's
	}
	order := ledger.Order{Session: session, At: clock.Now()}
	delta = &discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster, ResourceNamesSubscribe: []string{"*"}, InitialResourceVersions: map[string]string{}}
	sotw = &discovery.DiscoveryRequest{TypeUrl: xds.TypeEndpoint, VersionInfo: wire.Version(ledger.Hash{1}, order)}
	for i := range n {
		name := fmt.Sprintf("outbound|8080||svc-%05d.ns-%03d.svc.cluster.local", i, i%100)
		delta.InitialResourceVersions[name] = wire.Version(ledger.Hash(sha256.Sum256([]byte(name))), order)
		sotw.ResourceNames = append(sotw.ResourceNames, name)
	}
	return delta, sotw
}

// TestRequestLimitFitsA30kMesh measures the largest requests a real Envoy
// sends in the motivating mesh (30,000 services) and holds the defaults
// to them: the receive limit takes three times the largest, and the names
// limit a mesh of as many services with eight ports each.
func TestRequestLimitFitsA30kMesh(t *testing.T) {
	delta, sotw := meshRequests(30_000)
	largest := max(proto.Size(delta), proto.Size(sotw))
	cfg := DefaultXDSConfig()
	t.Logf("30,000 services: Delta CDS reconnect %d bytes, SotW EDS request %d bytes; limit %d bytes (%.1f×)",
		proto.Size(delta), proto.Size(sotw), cfg.MaxRequestBytes, float64(cfg.MaxRequestBytes)/float64(largest))
	if cfg.MaxRequestBytes < 3*largest {
		t.Errorf("MaxRequestBytes %d is less than three times the largest request of a 30k mesh (%d)", cfg.MaxRequestBytes, largest)
	}
	if cfg.MaxSubscribedNames < 8*30_000 {
		t.Errorf("MaxSubscribedNames %d is less than a 30k mesh's names at eight ports a service", cfg.MaxSubscribedNames)
	}

}

// TestRequestOverLimitRefused: a request past XDS.MaxRequestBytes ends its
// stream with ResourceExhausted before the relay decodes it (gRPC refuses
// it on its length), on SotW and Delta, and the relay goes on serving.
func TestRequestOverLimitRefused(t *testing.T) {
	up := newTestUpstream(t, "ns")
	seed(up, "ns", 3)
	r := startRelay(t, up, func(c *Config) { c.XDS.MaxRequestBytes = 1 << 20 })
	conn := dial(t, r.Addr().String())
	big := make([]string, 0, 40_000)
	for i := range cap(big) {
		big = append(big, fmt.Sprintf("outbound|8080||svc-%05d.ns.svc.cluster.local", i)) // ~1.9 MB in all
	}
	for _, delta := range []bool{false, true} {
		t.Run(fmt.Sprint("delta=", delta), func(t *testing.T) {
			c := newRawClient(t, conn, delta, node("ns", "big", 0))
			c.subscribe(xds.TypeEndpoint, big...)
			if err := c.streamErr(); status.Code(err) != codes.ResourceExhausted {
				t.Fatalf("stream ended with %v, want ResourceExhausted", err)
			}
			good := newRawClient(t, conn, delta, node("ns", "good", 0))
			good.subscribe(xds.TypeCluster)
			if got := names(good.recv()); len(got) != 3 {
				t.Fatalf("a good client after the refusal got %v, want 3 clusters", got)
			}
		})
	}
}

// TestRequestBudgetBoundsLargeRequests: ten streams each send a request
// of 1 MiB at once to a relay whose budget takes three; the handlers that
// hold theirs do not return. Three are handled, seven wait holding
// nothing more; as each handler returns the next one goes; at no moment
// are more than three held.
func TestRequestBudgetBoundsLargeRequests(t *testing.T) {
	r := newTestRelay(t, func(cfg *Config) { cfg.XDS.MaxRequestBytes, cfg.XDS.RequestBudgetBytes = 1<<20, 3<<20 })
	const streams = 10
	var read, handled atomic.Int32
	proceed := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, streams)
	for range streams {
		s := r.srv.newStream(ctx, true, portPlain)
		sent := false
		recv := func() (int, error) {
			if !sent {
				sent = true
				read.Add(1)
				return 1 << 20, nil
			}
			<-ctx.Done()
			return 0, io.EOF
		}
		size := func(n int) int { return n }
		go func() {
			done <- serve(s, recv, size, func(int) error {
				handled.Add(1)
				<-proceed
				return nil
			}, nil)
		}()
	}
	waitFor(t, "every request read and three handled", func() bool { return read.Load() == streams && handled.Load() == 3 })
	if in := budgetInUse(r); in != 3<<20 {
		t.Fatalf("budget in use %d, want 3 MiB", in)
	}
	for want := int32(4); want <= streams; want++ {
		proceed <- struct{}{}
		waitFor(t, fmt.Sprintf("request %d handled", want), func() bool { return handled.Load() == want })
	}
	for range 3 {
		proceed <- struct{}{}
	}
	waitFor(t, "the budget given back", func() bool { return budgetInUse(r) == 0 })
	if p := budgetPeak(r); p != 3<<20 {
		t.Fatalf("peak of the budget in use %d, want 3 MiB", p)
	}
	cancel()
	for range streams {
		if err := <-done; err != nil {
			t.Fatalf("serve = %v", err)
		}
	}
}

// TestRequestBudgetOverRealStreams: twelve Delta clients reconnect at
// once, each declaring 12,000 clusters (about 1.4 MB), through a relay
// whose budget takes four such requests: every one is answered, and the
// budget held at once never passed its bound.
func TestRequestBudgetOverRealStreams(t *testing.T) {
	up := newTestUpstream(t, "ns")
	seed(up, "ns", 3)
	r := startRelay(t, up, func(c *Config) {
		c.XDS.MaxRequestBytes = 2 << 20
		c.XDS.RequestBudgetBytes = 6 << 20
	})
	conn := dial(t, r.Addr().String())
	delta, _ := meshRequests(12_000)
	if size := proto.Size(delta); size < 1<<20 || size > 2<<20 {
		t.Fatalf("request of %d bytes: the test wants 1 to 2 MiB", size)
	}
	var clients []*rawClient
	for i := range 12 {
		c := newRawClient(t, conn, true, node("ns", "w", i))
		c.send(proto.Clone(delta))
		clients = append(clients, c)
	}
	for i, c := range clients {
		// The 3 clusters the key has; the 12,000 declared are pending
		// until XDS.ResourceWaitTimeout.
		if got := c.recvDelta(xds.TypeCluster); len(got.GetResources()) != 3 {
			t.Fatalf("client %d: %d resources, want 3", i, len(got.GetResources()))
		}
	}
	if p := budgetPeak(r); p == 0 || p > 6<<20 {
		t.Fatalf("peak of the budget in use %d, want (0, 6 MiB]", p)
	}
	if in := budgetInUse(r); in != 0 {
		t.Fatalf("budget in use %d after every request was handled", in)
	}
}

// TestRequestBudgetConfig: a budget that cannot take the largest request
// is refused.
func TestRequestBudgetConfig(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Upstream.Addr = "unused:1"
	cfg.XDS.RequestBudgetBytes = int64(cfg.XDS.MaxRequestBytes) - 1
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "XDS.RequestBudgetBytes") {
		t.Fatalf("New = %v, want an error naming XDS.RequestBudgetBytes", err)
	}
}

// TestKeyDoesNotAskForInventedNames: a client of a key subscribes to the
// endpoints of the key's one cluster and 30,000 names it made up. The
// key's stream to the upstream asks for the cluster's and at most
// maxUnknownNames of the others; the client gets its cluster's endpoints,
// and so does another client of the key.
func TestKeyDoesNotAskForInventedNames(t *testing.T) {
	for _, proto := range []Protocol{ProtocolSotW, ProtocolDelta} {
		t.Run(string(proto), func(t *testing.T) {
			up := newTestUpstream(t, "ns")
			seed(up, "ns", 1)
			r := startRelay(t, up, func(c *Config) { c.Upstream.Protocol = proto })
			conn := dial(t, r.Addr().String())
			invented := []string{"c0"}
			for i := range 30_000 {
				invented = append(invented, fmt.Sprint("made-up-", i))
			}
			c := newRawClient(t, conn, false, node("ns", "w", 0))
			c.subscribe(xds.TypeCluster)
			c.ack(c.recvSotW(xds.TypeCluster))
			c.subscribe(xds.TypeEndpoint, invented...)
			if got := names(c.recvSotW(xds.TypeEndpoint)); !slices.Equal(got, []string{"c0"}) {
				t.Fatalf("the inventing client got endpoints %v, want [c0]", got)
			}
			other := newRawClient(t, conn, true, node("ns", "w", 1))
			other.subscribe(xds.TypeEndpoint, "c0")
			if got := names(other.recvDelta(xds.TypeEndpoint)); !slices.Equal(got, []string{"c0"}) {
				t.Fatalf("another client of the key got endpoints %v, want [c0]", got)
			}
			asked := upstreamEndpointNames(up)
			if !asked["c0"] || len(asked) > 1+maxUnknownNames {
				t.Fatalf("the key asked the upstream for %d endpoint names (c0: %v), want c0 and at most %d more", len(asked), asked["c0"], maxUnknownNames)
			}
		})
	}
}

// upstreamEndpointNames is the largest set of endpoint names the upstream
// was asked for at once: a SotW request's, or a Delta stream's
// subscriptions added up.
func upstreamEndpointNames(up *testUpstream) map[string]bool {
	up.mu.Lock()
	defer up.mu.Unlock()
	most := map[string]bool{}
	for _, r := range up.sotwReqs {
		if r.GetTypeUrl() == xds.TypeEndpoint && len(r.GetResourceNames()) > len(most) {
			most = map[string]bool{}
			for _, n := range r.GetResourceNames() {
				most[n] = true
			}
		}
	}
	delta := map[string]bool{}
	for _, r := range up.deltaReq {
		if r.GetTypeUrl() != xds.TypeEndpoint {
			continue
		}
		for _, n := range r.GetResourceNamesSubscribe() {
			delta[n] = true
		}
		if len(delta) > len(most) {
			most = maps.Clone(delta)
		}
		for _, n := range r.GetResourceNamesUnsubscribe() {
			delete(delta, n)
		}
	}
	return most
}

func budgetInUse(r *Relay) int64 { n, _ := r.srv.budget.InUse(); return n }
func budgetPeak(r *Relay) int64  { _, p := r.srv.budget.InUse(); return p }

// TestRequestBudgetDefault: the default budget takes a largest request
// per two cores, at least one.
func TestRequestBudgetDefault(t *testing.T) {
	r := newTestRelay(t)
	if want := int64(r.cfg.XDS.MaxRequestBytes) * int64(max(1, runtime.GOMAXPROCS(0)/2)); r.cfg.XDS.RequestBudgetBytes != want {
		t.Fatalf("budget %d, want %d", r.cfg.XDS.RequestBudgetBytes, want)
	}
}
