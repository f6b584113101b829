package relay

import (
	"context"
	"errors"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/xds"
)

// A client connection may have XDS.MaxStreamsPerConnection streams open on
// an xDS port (HTTP/2 max concurrent streams, which also bounds rapid
// resets): one more waits for a slot, and gets one once a stream ends
// (issue 31, finding 7).
func TestStreamsPerConnectionBounded(t *testing.T) {
	up := newTestUpstream(t, "ns0")
	seed(up, "ns0", 1)
	r := startRelay(t, up, func(c *Config) { c.XDS.MaxStreamsPerConnection = 1 })
	conn := dial(t, r.Addr().String())
	ads := discovery.NewAggregatedDiscoveryServiceClient(conn)
	open := func(ctx context.Context, i int) error {
		st, err := ads.DeltaAggregatedResources(ctx)
		if err != nil {
			return err
		}
		if err := st.Send(&discovery.DeltaDiscoveryRequest{Node: node("ns0", "app", i), TypeUrl: xds.TypeCluster, ResourceNamesSubscribe: []string{"*"}}); err != nil {
			return err
		}
		_, err = st.Recv()
		return err
	}
	firstCtx, endFirst := context.WithCancel(context.Background())
	defer endFirst()
	if err := open(firstCtx, 0); err != nil {
		t.Fatalf("first stream: %v", err)
	}
	waitCtx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	err := open(waitCtx, 1)
	cancel()
	if status.Code(err) != codes.DeadlineExceeded && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a second stream on the connection while the first is open: %v, want it to wait for a slot", err)
	}
	endFirst()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := open(ctx, 2); err != nil {
		t.Fatalf("a stream once the first ended: %v", err)
	}
}

// A client connection on an xDS port ends after XDS.MaxConnectionAge and
// its grace (GOAWAY), as istiod's: the client reconnects through the
// Service (issue 31, finding 7).
func TestConnectionAged(t *testing.T) {
	up := newTestUpstream(t, "ns0")
	seed(up, "ns0", 1)
	r := startRelay(t, up, func(c *Config) {
		c.XDS.MaxConnectionAge, c.XDS.MaxConnectionAgeGrace = 500*time.Millisecond, 500*time.Millisecond
	})
	c := newRawClient(t, dial(t, r.Addr().String()), true, node("ns0", "app", 0))
	c.subscribe(xds.TypeCluster)
	c.ack(c.recvDelta(xds.TypeCluster))
	if err := c.streamErr(); status.Code(err) != codes.Unavailable {
		t.Fatalf("stream ended with %v, want Unavailable (the connection's age)", err)
	}
}

// A relay whose tier dials its plaintext xDS port (no peer port) takes a
// stream per key on another relay's one connection, whatever
// XDS.MaxStreamsPerConnection: two keys through one owner are both served.
func TestPeersNotBoundByStreamsPerConnection(t *testing.T) {
	up := newTestUpstream(t, "ns0", "ns1")
	seed(up, "ns0", 1)
	seed(up, "ns1", 1)
	owner := startRelay(t, up, func(c *Config) {
		c.ID, c.XDS.MaxStreamsPerConnection, c.Tier.Owners = "owner", 1, newFakeOwners("", true)
	})
	other := startRelay(t, up, func(c *Config) { c.ID = "other"; c.Tier.Owners = newFakeOwners(owner.Addr().String(), false) })
	conn := dial(t, other.Addr().String())
	for _, ns := range []string{"ns0", "ns1"} {
		c := newRawClient(t, conn, true, node(ns, "app", 0))
		c.subscribe(xds.TypeCluster)
		c.ack(c.recvDelta(xds.TypeCluster))
	}
	waitFor(t, "both keys fed by the owner", func() bool { return other.Stats().PeerStreams == 2 })
}
