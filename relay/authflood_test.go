package relay

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/admission"
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

// countingAuth counts the verifications an Authenticator makes that fail.
type countingAuth struct {
	Authenticator
	failed *atomic.Int64
}

func (c countingAuth) Authenticate(ctx context.Context) (auth.Identity, error) {
	id, err := c.Authenticator.Authenticate(ctx)
	if err != nil {
		c.failed.Add(1)
	}
	return id, err
}

// A flood of failing authentications costs bounded verifications: the
// same expired token retried from one address is verified about once
// (then refused as it was, unverified), made-up tokens from another
// address admission.FailBurst times and then once a admission.FailInterval. Neither keeps a
// good client out, not even one behind the first flood's own address
// (SNAT, hostNetwork pods).
func TestTLSPortAuthFloodDoesNotStarveOthers(t *testing.T) {
	var verified atomic.Int64
	e := newSecureEnv(t, auth.ModeJWT, func(c *Config) { c.XDS.Authenticator = countingAuth{c.XDS.Authenticator, &verified} })
	expired := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app", IssuedAt: time.Now().Add(-3 * time.Hour)})
	good := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"})
	retrying, inventing := e.dialFrom(t, "127.0.0.2"), e.dialFrom(t, "127.0.0.3")
	start := time.Now()
	var wg sync.WaitGroup
	var mu sync.Mutex
	codesSeen := map[codes.Code]int{}
	var made atomic.Int64
	for i := range 16 {
		wg.Go(func() {
			for range 100 {
				conn, tok := retrying, expired
				if i%2 == 1 {
					conn, tok = inventing, expired+fmt.Sprint(made.Add(1)) // a token no one signed
				}
				_, err := openWith(conn, metadata.Pairs("authorization", "Bearer "+tok), true)
				mu.Lock()
				codesSeen[status.Code(err)]++
				mu.Unlock()
			}
		})
	}
	for i := range 20 {
		conn := e.dialFrom(t, "127.0.0.1")
		if i%2 == 1 {
			conn = retrying // behind the retrying flood's address
		}
		if _, err := openWith(conn, metadata.Pairs("authorization", "Bearer "+good), true); err != nil {
			t.Fatalf("good client %d during the flood: %v", i, err)
		}
	}
	wg.Wait()
	elapsed := time.Since(start)
	// At most: the expired token once per admission.BadFor, the made-up ones as
	// many as came at once before the first failed (8), admission.FailBurst and one
	// a admission.FailInterval.
	bound := (1 + elapsed.Seconds()/admission.BadFor.Seconds()) + 8 + float64(admission.FailBurst) + elapsed.Seconds()/admission.FailInterval.Seconds() + 1
	if v := float64(verified.Load()); v > bound {
		t.Fatalf("%v failing credentials verified in %v, want at most %.1f", v, elapsed, bound)
	}
	if codesSeen[codes.Unauthenticated] != 16*100 {
		t.Fatalf("flood answers %v, want every one Unauthenticated", codesSeen)
	}
	if authFailures(e.r, "throttled") == 0 {
		t.Fatal("no made-up token was refused before verification")
	}
	if authFailures(e.r, "expired") < 8*100 {
		t.Fatalf("auth failures{expired} = %v: the expired token's refusals should name why, verified or not", authFailures(e.r, "expired"))
	}
}

// A workload with a good token that opens streams as fast as it can
// delays its own streams, not another identity's: with the bucket empty
// and 40 of the flood's streams waiting, a stream of another service
// account is admitted before all but a few of them.
func TestTLSPortFloodOfOneIdentityDoesNotDelayAnother(t *testing.T) {
	e := newSecureEnv(t, auth.ModeJWT, func(c *Config) { c.XDS.AdmitRate, c.XDS.AdmitBurst, c.XDS.AdmitWait = 5, 1, time.Minute })
	flooder := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"})
	other := e.issuer.Sign(t, authtest.Token{Namespace: "ns2", ServiceAccount: "other"})
	conn := e.dialFrom(t, "127.0.0.1")
	open := func(tok string, n *core.Node) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(metadata.NewOutgoingContext(ctx, metadata.Pairs("authorization", "Bearer "+tok)))
		if err != nil {
			return err
		}
		st.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster, Node: n})
		_, err = st.Recv()
		return err
	}
	var mu sync.Mutex
	var events []string
	e.r.srv.admission.SetTrace(func(event, who string) { mu.Lock(); events = append(events, event+" "+who); mu.Unlock() })
	var wg sync.WaitGroup
	for i := range 40 {
		wg.Go(func() {
			if err := open(flooder, saNode("ns1", "app", i)); err != nil {
				t.Errorf("flood stream %d: %v", i, err)
			}
		})
	}
	waitFor(t, "the flood's streams waiting", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(events) >= 10
	})
	if err := open(other, saNode("ns2", "other", 1)); err != nil {
		t.Fatalf("the other identity's stream: %v", err)
	}
	wg.Wait()
	// Between the other identity's stream queueing and its grant, at most
	// one token went to the flood (the one being handed out as it came).
	mu.Lock()
	defer mu.Unlock()
	const otherID = "spiffe://cluster.local/ns/ns2/sa/other"
	queued, granted := slices.Index(events, "queued "+otherID), slices.Index(events, "granted "+otherID)
	if queued < 0 || granted < queued {
		t.Fatalf("the other identity's stream was not queued and granted: %v", events)
	}
	floodGrants := 0
	for _, ev := range events[queued:granted] {
		if strings.HasPrefix(ev, "granted ") {
			floodGrants++
		}
	}
	if floodGrants > 1 {
		t.Fatalf("%d flood streams admitted while the other identity's waited: %v", floodGrants, events[queued:granted+1])
	}
}

// A stream ends, Unauthenticated, when the token it was admitted with
// expires; the client's refreshed token opens a new one.
func TestTLSPortStreamEndsWhenItsTokenExpires(t *testing.T) {
	e := newSecureEnv(t, auth.ModeJWT, nil)
	short := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app", TTL: expiryFloor + time.Second})
	conn := e.dialFrom(t, "127.0.0.1")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(metadata.NewOutgoingContext(ctx, metadata.Pairs("authorization", "Bearer "+short)))
	if err != nil {
		t.Fatal(err)
	}
	st.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.TypeCluster, Node: saNode("ns1", "app", 1)})
	if _, err := st.Recv(); err != nil {
		t.Fatalf("first response: %v", err)
	}
	for {
		_, err := st.Recv()
		if err == nil {
			continue
		}
		if status.Code(err) != codes.Unauthenticated || !strings.Contains(err.Error(), "expired") {
			t.Fatalf("stream ended with %v, want Unauthenticated: expired", err)
		}
		break
	}
	fresh := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"})
	if _, err := openWith(conn, metadata.Pairs("authorization", "Bearer "+fresh), true); err != nil {
		t.Fatalf("reconnect with a fresh token: %v", err)
	}
}

// A workload that opens streams up to the relay's bound holds them until
// another identity comes: its newest stream gives way (Unavailable), the
// other is served, and the workload's next stream is refused.
func TestStreamBoundSharedByIdentity(t *testing.T) {
	up := newTestUpstream(t, "ns")
	seed(up, "ns", 1)
	r := startRelay(t, up, func(c *Config) { c.XDS.MaxStreams = 4 })
	from := func(src string) *grpc.ClientConn {
		d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		conn, err := grpc.NewClient(r.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) }))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	flood, good := from("127.0.0.2"), from("127.0.0.1")
	var floods []*rawClient
	for i := range 4 {
		c := newRawClient(t, flood, true, node("ns", "flood", i))
		c.subscribe(xds.TypeCluster)
		c.recvDelta(xds.TypeCluster)
		floods = append(floods, c)
	}
	g := newRawClient(t, good, true, node("ns", "good", 0))
	g.subscribe(xds.TypeCluster)
	g.recvDelta(xds.TypeCluster)
	if err := floods[3].streamErr(); status.Code(err) != codes.Unavailable {
		t.Fatalf("the flood's newest stream ended with %v, want Unavailable", err)
	}
	again := newRawClient(t, flood, true, node("ns", "flood", 9))
	again.subscribe(xds.TypeCluster)
	if err := again.streamErr(); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("the flood's stream past its share ended with %v, want ResourceExhausted", err)
	}
	if got := testutil.ToFloat64(r.metrics.Shed.WithLabelValues("share")); got != 1 {
		t.Fatalf("moved{share} = %v, want 1", got)
	}
}
