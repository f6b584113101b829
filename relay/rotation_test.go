package relay

import (
	"crypto/tls"
	"fmt"
	"math/big"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"

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

// Certificates rotate on all three listeners (the TLS xDS port, the peer
// port, the admin port) while config flows to Envoys over TLS: no stream
// is dropped (every Envoy gets every change, on its first stream), and
// every handshake after a rotation gets the new certificate.
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
		c.XDSListen, c.XDSTLSListen = "", "127.0.0.1:0"
		c.XDSTLS = tlsfiles.ServerConfig(xdsCert.pair, roots, tls.RequestClientCert)
		c.Authenticator = e.r.cfg.Authenticator
		c.PeerListen, c.PeerTLS = "127.0.0.1:0", peerServer
		c.AdminListen, c.AdminTLS = "127.0.0.1:0", tlsfiles.ServerConfig(adminCert.pair, nil, tls.NoClientCert, "h2", "http/1.1")
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
	for _, c := range clients {
		for got := false; !got; {
			m := c.recvDelta(xds.TypeCluster) // fails the test if the stream ended
			got = slices.Contains(names(m), last)
			c.ack(m)
		}
	}
	if st := r.Stats(); st.Streams != envoys {
		t.Fatalf("relay holds %d Envoy streams after the rotations, want the %d it started with", st.Streams, envoys)
	}
}
