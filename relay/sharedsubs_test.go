package relay

import (
	"context"
	"slices"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"

	"github.com/meshrelay/meshrelay/relay/xds"
)

// Two Envoys of a key that subscribe to the same EDS names share one name
// set (the relay holds one); when one of them unsubscribes a name, the
// other's subscription is what it was: it still gets that name's changes,
// and the first does not.
func TestStreamsShareSubscriptions(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	eds := seedN(up, "ns1", 3)
	r := startRelay(t, up, nil)
	conn := dial(t, r.Addr().String())
	a := newRawClient(t, conn, true, node("ns1", "app", 1))
	b := newRawClient(t, conn, true, node("ns1", "app", 2))
	for _, c := range []*rawClient{a, b} {
		c.subscribe(xds.TypeEndpoint, eds...)
		c.ack(c.recvDelta(xds.TypeEndpoint))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	waitCtx(ctx, t, "one name set for the two streams", func() bool { return r.cache.nameSets.Len() == 1 })
	a.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeEndpoint, ResourceNamesUnsubscribe: eds[1:2]})
	waitCtx(ctx, t, "a set of its own for the stream that unsubscribed", func() bool { return r.cache.nameSets.Len() == 2 })
	up.set("ns1", xds.TypeEndpoint, mkCLA(eds[0], 8080), mkCLA(eds[1], 9999), mkCLA(eds[2], 8080))
	if got := names(b.recvDelta(xds.TypeEndpoint)); !slices.Equal(got, eds[1:2]) {
		t.Fatalf("the stream still subscribed got %v, want %v", got, eds[1:2])
	}
	a.quiet()
}
