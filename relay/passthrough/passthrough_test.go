package passthrough_test

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/relay/adsclient/adsclienttest"
	"github.com/meshrelay/meshrelay/relay/passthrough"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// start runs a passthrough for a client of the given protocol to cp,
// stopped when the test ends.
func start(t *testing.T, cp *adsclienttest.ControlPlane, delta bool) *passthrough.Passthrough {
	t.Helper()
	conn, err := grpc.NewClient(cp.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	p := passthrough.New(context.Background(), passthrough.Config{
		Conn: conn, Node: &core.Node{Id: adsclienttest.NodeID}, Delta: delta,
		Backoff: func() time.Duration { return 10 * time.Millisecond },
		Log:     slog.New(slog.DiscardHandler),
	})
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.Run()
	}()
	t.Cleanup(func() {
		p.Stop()
		<-done
	})
	return p
}

// answer waits for the passthrough's next answer.
func answer(t *testing.T, ctx context.Context, p *passthrough.Passthrough) proto.Message {
	t.Helper()
	select {
	case m := <-p.Out():
		return m
	case err := <-p.Refused():
		t.Fatalf("refused: %v", err)
	case <-ctx.Done():
		t.Fatal("no answer came")
	}
	return nil
}

// TestSotWNonces: a request goes up without the client's node (the
// upstream stream presents it once), the answer comes back under the
// relay's nonce, the client's ACK of that nonce reaches the upstream as
// the upstream's own nonce, and a nonce the relay never gave as one the
// upstream cannot mistake for its own.
func TestSotWNonces(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cp := adsclienttest.Start(t, "127.0.0.1:0")
	cp.Set(t, "v1", "a")
	p := start(t, cp, false)
	if err := p.SotW(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType, Node: &core.Node{Id: "from-the-client"}}); err != nil {
		t.Fatal(err)
	}
	m := answer(t, ctx, p).(*discovery.DiscoveryResponse)
	upstreamNonce := m.GetNonce()
	cp0 := &core.ControlPlane{Identifier: "relay"}
	p.Relabel(m, "relay-1", cp0)
	if m.GetNonce() != "relay-1" || m.GetControlPlane() != cp0 {
		t.Fatalf("relabelled answer: nonce %q, control plane %v; want relay-1 and the relay's", m.GetNonce(), m.GetControlPlane())
	}
	if err := p.SotW(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType, VersionInfo: "v1", ResponseNonce: "relay-1"}); err != nil {
		t.Fatal(err)
	}
	if err := p.SotW(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType, VersionInfo: "v1", ResponseNonce: "relay-unknown"}); err != nil {
		t.Fatal(err)
	}
	adsclienttest.WaitFor(t, ctx, "three requests upstream", func() bool { return len(cp.SotWRequests()) >= 3 })
	reqs := cp.SotWRequests()
	if reqs[0].GetNode().GetId() != adsclienttest.NodeID {
		t.Errorf("first request presented %v, want the configured node", reqs[0].GetNode())
	}
	if got := reqs[1].GetResponseNonce(); got != upstreamNonce {
		t.Errorf("the ACK reached the upstream with nonce %q, want the upstream's %q", got, upstreamNonce)
	}
	if got := reqs[2].GetResponseNonce(); got != "meshrelay-stale-relay-unknown" {
		t.Errorf("an unknown nonce reached the upstream as %q, want meshrelay-stale-relay-unknown", got)
	}
}

// TestDeltaReplaysAfterReconnect: when the upstream stream breaks, the new
// one asks for what the client subscribed to, telling the versions the
// client was given, without a nonce.
func TestDeltaReplaysAfterReconnect(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cp := adsclienttest.Start(t, "127.0.0.1:0")
	cp.Set(t, "v1", "a", "b")
	p := start(t, cp, true)
	if err := p.Delta(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.ClusterType, ResourceNamesSubscribe: []string{"a"}}); err != nil {
		t.Fatal(err)
	}
	m := answer(t, ctx, p).(*discovery.DeltaDiscoveryResponse)
	if len(m.GetResources()) != 1 || m.GetResources()[0].GetName() != "a" {
		t.Fatalf("answer %v, want cluster a", m.GetResources())
	}
	version := m.GetResources()[0].GetVersion()
	p.Relabel(m, "relay-1", nil)

	cp.Stop()
	cp2 := adsclienttest.Start(t, cp.Addr)
	cp2.Set(t, "v1", "a", "b")
	adsclienttest.WaitFor(t, ctx, "the replay upstream", func() bool { return len(cp2.DeltaRequests()) >= 1 })
	r := cp2.DeltaRequests()[0]
	if !slices.Equal(r.GetResourceNamesSubscribe(), []string{"a"}) || r.GetInitialResourceVersions()["a"] != version || r.GetResponseNonce() != "" {
		t.Fatalf("replayed %v (versions %v, nonce %q), want a at %s and no nonce", r.GetResourceNamesSubscribe(), r.GetInitialResourceVersions(), r.GetResponseNonce(), version)
	}
}

// TestRefusalEndsIt: an upstream that refuses the client's credentials is
// not asked again; the client hears the refusal.
func TestRefusalEndsIt(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cp := adsclienttest.Start(t, "127.0.0.1:0")
	cp.Refuse(status.Error(codes.PermissionDenied, "not yours"))
	p := start(t, cp, false)
	if err := p.SotW(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-p.Refused():
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "not yours") {
			t.Fatalf("refused with %v, want the upstream's PermissionDenied", err)
		}
	case m := <-p.Out():
		t.Fatalf("a refused stream answered %v", m)
	case <-ctx.Done():
		t.Fatal("the refusal never came")
	}
	n := len(cp.SotWRequests())
	time.Sleep(50 * time.Millisecond) // five backoffs: a retry would show
	if got := len(cp.SotWRequests()); got != n {
		t.Fatalf("the upstream was asked again after its refusal (%d requests, then %d)", n, got)
	}
}

// TestQueueBound: a client whose requests pile up faster than the upstream
// takes them is refused (its own stream ends), without blocking.
func TestQueueBound(t *testing.T) {
	p := passthrough.New(context.Background(), passthrough.Config{Log: slog.New(slog.DiscardHandler)})
	defer p.Stop() // never ran: returns at once
	var err error
	for i := 0; err == nil && i < 1000; i++ {
		err = p.SotW(&discovery.DiscoveryRequest{TypeUrl: resource.ClusterType})
	}
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("the flood ended with %v, want ResourceExhausted", err)
	}
}
