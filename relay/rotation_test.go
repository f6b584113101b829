package relay

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"math/big"
	"net"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/xds"

	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
)

// rotating is a certificate in files that a test replaces, as
// cert-manager or a Secret volume does.
type rotating struct {
	ca   *authtest.CA
	leaf authtest.Leaf
	dir  string
	pair *tlsfiles.KeyPair
}

func newRotating(t *testing.T, ca *authtest.CA, leaf authtest.Leaf) *rotating {
	t.Helper()
	r := &rotating{ca: ca, leaf: leaf, dir: t.TempDir()}
	cert, key := ca.Issue(t, leaf).Write(t, r.dir)
	var err error
	if r.pair, err = tlsfiles.LoadKeyPair(cert, key); err != nil {
		t.Fatal(err)
	}
	return r
}

// rotate writes a new certificate and returns its serial number.
func (r *rotating) rotate(t *testing.T) *big.Int {
	t.Helper()
	is := r.ca.Issue(t, r.leaf)
	is.Write(t, r.dir)
	return is.Leaf().SerialNumber
}

// serialAt handshakes with addr and returns the serial of the
// certificate it served.
func serialAt(t *testing.T, addr string, tc *tls.Config) *big.Int {
	t.Helper()
	d := &net.Dialer{Timeout: 5 * time.Second}
	c, err := tls.DialWithDialer(d, "tcp", addr, tc)
	if err != nil {
		t.Fatalf("handshake with %s: %v", addr, err)
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0].SerialNumber
}

// onceDialer dials addr over TLS once: a second dial (the connection was
// dropped and gRPC would make another) fails.
type onceDialer struct {
	addr  string
	tc    *tls.Config
	dials atomic.Int32
}

func (d *onceDialer) dial(ctx context.Context, _ string) (net.Conn, error) {
	if d.dials.Add(1) > 1 {
		return nil, errors.New("dialled again: the first connection was dropped")
	}
	return (&tls.Dialer{Config: d.tc}).DialContext(ctx, "tcp", d.addr)
}

// conn is a gRPC connection over the dialer's one TLS connection.
func (d *onceDialer) conn(t *testing.T) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+d.addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithContextDialer(d.dial))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// withMD is a connection that adds md to every stream it opens.
type withMD struct {
	grpc.ClientConnInterface
	md metadata.MD
}

func (c withMD) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	return c.ClientConnInterface.NewStream(metadata.NewOutgoingContext(ctx, c.md), desc, method, opts...)
}

// Certificates rotate on all three listeners (the TLS xDS port, the peer
// port, the admin port) while config flows to Envoys over TLS and to
// another relay over the peer port, and an admin client holds a
// connection: no stream is dropped (every Envoy and the relay get every
// change, on their first stream; the admin client's connection is the one
// it made before the rotations), and every handshake after a rotation gets
// the new certificate.
func TestCertificateRotationOnEveryListener(t *testing.T) {
	const envoys, changes = 20, 30
	e := newSecureEnv(t, auth.ModeJWT, nil)
	tierID := "spiffe://cluster.local/ns/istio-system/sa/meshrelay"
	xdsCert := newRotating(t, e.mesh, authtest.Leaf{DNSNames: []string{"meshrelay.istio-system.svc"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	peerCert := newRotating(t, e.mesh, authtest.Leaf{URIs: []string{tierID}})
	adminCert := newRotating(t, e.mesh, authtest.Leaf{DNSNames: []string{"localhost"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	roots, err := tlsfiles.LoadCAPool(e.mesh.WriteRoot(t))
	if err != nil {
		t.Fatal(err)
	}
	peerServer, peerClient, err := auth.PeerTLS(peerCert.pair, roots, tierID)
	if err != nil {
		t.Fatal(err)
	}
	// A relay of its own, whose three listeners serve the rotating files.
	r := startRelay(t, e.up, func(c *Config) {
		c.XDS.Listen, c.XDS.TLSListen = "", "127.0.0.1:0"
		c.XDS.TLS = tlsfiles.ServerConfig(xdsCert.pair, roots, tls.RequestClientCert)
		c.XDS.Authenticator = e.r.cfg.XDS.Authenticator
		c.Tier.Listen, c.Tier.TLS = "127.0.0.1:0", peerServer
		c.Admin.Listen, c.Admin.TLS = "127.0.0.1:0", tlsfiles.ServerConfig(adminCert.pair, nil, tls.NoClientCert, "h2", "http/1.1")
	})
	e.r = r
	xdsClient := &tls.Config{RootCAs: e.mesh.Pool(), ServerName: "meshrelay.istio-system.svc", NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS12}
	adminClient := &tls.Config{RootCAs: e.mesh.Pool(), ServerName: "localhost", MinVersion: tls.VersionTLS12}
	peerDial := peerClient.Clone()
	peerDial.NextProtos = []string{"h2"}
	listeners := []struct {
		name string
		addr string
		tc   *tls.Config
		cert *rotating
	}{
		{"xds", r.TLSAddr().String(), xdsClient, xdsCert},
		{"peer", r.PeerAddr().String(), peerDial, peerCert},
		{"admin", r.AdminAddr().String(), adminClient, adminCert},
	}

	var clients []*rawClient
	for i := range envoys {
		tok := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app"})
		c := newRawClient(t, e.dial(t, creds{token: tok, perRPC: true}), true, saNode("ns1", "app", i))
		c.subscribe(xds.TypeCluster, "*")
		c.ack(c.recvDelta(xds.TypeCluster))
		clients = append(clients, c)
	}
	// Another relay of the tier subscribes to the key over the peer port,
	// and an admin client connects, both before the rotations.
	peerConn := &onceDialer{addr: r.PeerAddr().String(), tc: peerDial}
	peerMD := metadata.Pairs(peers.MDRelay, "relay-x", peers.MDKey, string(aggkey.Istio{}.Key(node("ns1", "app", 1))))
	peerStream := newRawClient(t, withMD{peerConn.conn(t), peerMD}, true, saNode("ns1", "app", 99))
	peerStream.subscribe(xds.TypeCluster, "*")
	peerStream.ack(peerStream.recvDelta(xds.TypeCluster))
	adminConn := &onceDialer{addr: r.AdminAddr().String(), tc: adminClient.Clone()}
	adminConn.tc.NextProtos = []string{"h2"}
	admin := healthpb.NewHealthClient(adminConn.conn(t))
	healthy := func(when string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if h, err := admin.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("admin health check %s: %v, %v", when, h, err)
		}
	}
	healthy("before the rotations")

	// Changes flow while the files rotate, each listener twice.
	done := make(chan struct{})
	go func() {
		defer close(done)
		cs := []types.Resource{mkCluster("c0"), mkCluster("c1"), mkCluster("c2")}
		for i := range changes {
			cs = append(cs, mkCluster(fmt.Sprint("rot-", i)))
			e.up.set("ns1", xds.TypeCluster, cs...)
			time.Sleep(5 * time.Millisecond)
		}
	}()
	for round := range 2 {
		for _, l := range listeners {
			want := l.cert.rotate(t)
			if got := serialAt(t, l.addr, l.tc); got.Cmp(want) != 0 {
				t.Fatalf("round %d: %s listener served serial %v after the rotation, want the new %v", round, l.name, got, want)
			}
		}
	}
	<-done
	last := fmt.Sprint("rot-", changes-1)
	for _, c := range append(clients, peerStream) {
		for got := false; !got; {
			m := c.recvDelta(xds.TypeCluster) // fails the test if the stream ended
			got = slices.Contains(names(m), last)
			c.ack(m)
		}
	}
	if st := r.Stats(); st.Streams != envoys || st.PeerClients != 1 {
		t.Fatalf("relay holds %d Envoy and %d relay streams after the rotations, want the %d and 1 it started with", st.Streams, st.PeerClients, envoys)
	}
	healthy("after the rotations")
	for name, d := range map[string]*onceDialer{"peer": peerConn, "admin": adminConn} {
		if n := d.dials.Load(); n != 1 {
			t.Fatalf("the %s client dialled %d times: its connection was dropped", name, n)
		}
	}
}
