package relay

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/xds"

	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

// dialFrom dials the relay's TLS port from the loopback address src.
func (e *secureEnv) dialFrom(t *testing.T, src string) *grpc.ClientConn {
	t.Helper()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	tc := &tls.Config{RootCAs: e.mesh.Pool(), ServerName: "meshrelay.istio-system.svc", MinVersion: tls.VersionTLS12}
	conn, err := grpc.NewClient(e.r.TLSAddr().String(), grpc.WithTransportCredentials(credentials.NewTLS(tc)),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// openWith opens a Delta stream with the given metadata and returns the
// first response or the error.
func openWith(conn *grpc.ClientConn, md metadata.MD, n any) (*discovery.DeltaDiscoveryResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(metadata.NewOutgoingContext(ctx, md))
	if err != nil {
		return nil, err
	}
	req := &discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster}
	if n != nil {
		req.Node = saNode("ns1", "app", 1)
	}
	st.Send(req)
	return st.Recv()
}

// Bad credentials each get a clear status and cost bounded work; the relay
// keeps serving a good client throughout.
func TestTLSPortBadInput(t *testing.T) {
	e := newSecureEnv(t, auth.ModeJWT, func(c *Config) { c.XDS.HandshakeTimeout = 300 * time.Millisecond })
	good := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"})
	served := func() {
		t.Helper()
		if _, err := openWith(e.dial(t, creds{}), metadata.Pairs("authorization", "Bearer "+good), true); err != nil {
			t.Fatalf("good client: %v", err)
		}
	}
	// A good client's stream, open before the bad input and through it.
	longLived := newRawClient(t, e.dial(t, creds{token: good, perRPC: true}), true, saNode("ns1", "app", 2))
	longLived.subscribe(xds.TypeCluster, "*")
	longLived.ack(longLived.recvDelta(xds.TypeCluster))
	conn := e.dial(t, creds{})
	three, many := metadata.MD{}, metadata.MD{}
	for range 3 {
		three.Append("authorization", "Bearer "+good)
	}
	for range 500 {
		many.Append("authorization", "Bearer "+good)
	}
	for _, tc := range []struct {
		name string
		md   metadata.MD
		want codes.Code
	}{
		{"authorization over 16 KiB", metadata.Pairs("authorization", "Bearer "+strings.Repeat("a", 20<<10)), codes.Unauthenticated},
		{"three authorization headers", three, codes.Unauthenticated},
		// Past the server's header limit (64 KiB): refused by the
		// transport, before any of it is held by the relay.
		{"500 authorization headers", many, codes.Internal},
		{"garbage scheme", metadata.Pairs("authorization", "B%%r3r! x"), codes.Unauthenticated},
		{"garbage token", metadata.Pairs("authorization", "Bearer ..."), codes.Unauthenticated},
		{"a megabyte of headers", metadata.Pairs("x-junk", strings.Repeat("j", 1<<20)), codes.Internal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := openWith(conn, tc.md, true)
			if resp != nil || status.Code(err) != tc.want {
				t.Fatalf("stream: %v, %v; want %s and nothing served", resp, err, tc.want)
			}
			served()
		})
	}

	t.Run("handshake never finished", func(t *testing.T) {
		c, err := net.Dial("tcp", e.r.TLSAddr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		served() // while the silent connection waits
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, err := io.ReadAll(c); err != nil {
			t.Fatalf("the silent connection was not closed by the relay: %v", err)
		}
	})

	// The stream opened before it all is still served: a change reaches it.
	e.up.set("ns1", xds.TypeCluster, mkCluster("c0"), mkCluster("c1"), mkCluster("c2"), mkCluster("after-bad-input"))
	if got := names(longLived.recvDelta(xds.TypeCluster)); !slices.Equal(got, []string{"after-bad-input"}) {
		t.Fatalf("the long-lived stream got %v after the bad input, want the new cluster", got)
	}
}

// A flood of failing authentications from one address costs a bounded
// number of verifications (failBurst, then one a failInterval) and does
// not keep a good client from another address out.
func TestTLSPortAuthFloodDoesNotStarveOthers(t *testing.T) {
	e := newSecureEnv(t, auth.ModeJWT, nil)
	bad := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app", IssuedAt: time.Now().Add(-3 * time.Hour)}) // expired
	good := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"})
	flood, clean := e.dialFrom(t, "127.0.0.2"), e.dialFrom(t, "127.0.0.1")
	start := time.Now()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	codesSeen := map[codes.Code]int{}
	for range 16 {
		wg.Go(func() {
			for i := 0; i < 200; i++ {
				select {
				case <-stop:
					return
				default:
				}
				_, err := openWith(flood, metadata.Pairs("authorization", "Bearer "+bad), true)
				mu.Lock()
				codesSeen[status.Code(err)]++
				mu.Unlock()
			}
		})
	}
	for i := range 20 {
		if _, err := openWith(clean, metadata.Pairs("authorization", "Bearer "+good), true); err != nil {
			t.Fatalf("good client %d during the flood: %v", i, err)
		}
	}
	wg.Wait()
	close(stop)
	elapsed := time.Since(start)
	verified := authFailures(e.r, "expired")
	if bound := float64(failBurst) + elapsed.Seconds()/failInterval.Seconds() + 1; verified > bound {
		t.Fatalf("%v tokens of the flooding address verified in %v, want at most %v", verified, elapsed, bound)
	}
	if codesSeen[codes.Unauthenticated] != 16*200 {
		t.Fatalf("flood answers %v, want every one Unauthenticated", codesSeen)
	}
	if authFailures(e.r, "throttled") == 0 {
		t.Fatal("no flood stream was refused before verification")
	}
}
