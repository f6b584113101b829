package relay

import (
	"context"
	"crypto/tls"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/xds"

	"github.com/meshrelay/meshrelay/ledger/ledgerpb"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
)

const tierID = "spiffe://cluster.local/ns/istio-system/sa/meshrelay"

// peerTLS returns the peer port's server config and a relay's client
// config for a certificate of ca naming id.
func peerTLS(t *testing.T, ca *authtest.CA, root *authtest.CA, id string) (server, client *tls.Config) {
	t.Helper()
	pair, roots := peerKeys(t, ca, root, id)
	server, client, err := auth.PeerTLS(pair, roots, tierID)
	if err != nil {
		t.Fatal(err)
	}
	return server, client
}

// peerKeys returns a key pair for a certificate of ca naming id, and
// root's pool, as the files a relay reads them from.
func peerKeys(t *testing.T, ca *authtest.CA, root *authtest.CA, id string) (*tlsfiles.KeyPair, *tlsfiles.CAPool) {
	t.Helper()
	cert, key := ca.Issue(t, authtest.Leaf{URIs: []string{id}}).Write(t, "")
	pair, err := tlsfiles.LoadKeyPair(cert, key)
	if err != nil {
		t.Fatal(err)
	}
	roots, err := tlsfiles.LoadCAPool(root.WriteRoot(t))
	if err != nil {
		t.Fatal(err)
	}
	return pair, roots
}

// peerCalls makes the three relay-to-relay calls, as relay "relay-x" of
// the tier with the peer secret, on conn, and returns their errors.
func peerCalls(t *testing.T, r *Relay, conn *grpc.ClientConn) map[string]error {
	t.Helper()
	key := string(aggkey.Istio{}.Key(node("ns1", "app", 1)))
	// Each call with its own proof, as the relay's pool signs them.
	as := func(method, key string) context.Context {
		kv := []string{peers.MDRelay, "relay-x", peers.MDAuth, peers.Prover{Secret: r.cfg.Tier.Secret, ID: "relay-x"}.Proof(method, key)}
		if key != "" {
			kv = append(kv, peers.MDKey, key)
		}
		return metadata.AppendToOutgoingContext(context.Background(), kv...)
	}
	out := map[string]error{}
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(as(methodDelta, key))
	if err == nil {
		st.Send(&discovery.DeltaDiscoveryRequest{Node: node("ns1", "app", 1), TypeUrl: xds.TypeCluster})
		_, err = st.Recv()
	}
	out["subscribe"] = err
	_, out["ledger"] = ledgerpb.NewLedgerClient(conn).GetSummary(as(ledgerpb.Ledger_GetSummary_FullMethodName, ""), &ledgerpb.SummaryRequest{})
	_, out["inspect"] = inspectpb.NewInspectClient(conn).GetKey(as(inspectpb.Inspect_GetKey_FullMethodName, ""), &inspectpb.KeyRequest{Key: "x"})
	return out
}

// The peer port with mTLS admits relays by their certificate alone: a
// process that holds the tier's secret (the gossip key) but not a
// certificate naming the tier (none, or one of another identity or CA)
// cannot subscribe to a key, read the ledger or inspect, there or on the
// xDS port; Envoys are not served on it.
func TestPeerPortMTLS(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	seed(up, "ns1", 2)
	tierCA, otherCA := authtest.NewCA(t, "tier root"), authtest.NewCA(t, "other root")
	server, good := peerTLS(t, tierCA, tierCA, tierID)
	r := startRelay(t, up, func(c *Config) {
		c.Tier.Listen = "127.0.0.1:0"
		c.Tier.TLS = server
		c.Tier.Secret = []byte("the tier's secret")
	})
	peerAddr := r.peerLis.Addr().String()
	dialWith := func(addr string, tc *tls.Config) *grpc.ClientConn {
		cr := insecure.NewCredentials()
		if tc != nil {
			cr = credentials.NewTLS(tc)
		}
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(cr))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	_, wrongID := peerTLS(t, tierCA, tierCA, "spiffe://cluster.local/ns/istio-system/sa/intruder")
	_, wrongRoot := peerTLS(t, otherCA, tierCA, tierID)
	noCert := withoutCertificate(good)
	for _, tc := range []struct {
		name string
		conn *grpc.ClientConn
		want codes.Code
	}{
		{"tier certificate", dialWith(peerAddr, good), codes.OK},
		{"certificate of another identity", dialWith(peerAddr, wrongID), codes.Unavailable},
		{"certificate of another root", dialWith(peerAddr, wrongRoot), codes.Unavailable},
		{"TLS without a certificate", dialWith(peerAddr, noCert), codes.Unavailable},
		{"no TLS", dialWith(peerAddr, nil), codes.Unavailable},
		{"secret alone, on the xDS port", dialWith(r.Addr().String(), nil), codes.PermissionDenied},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for call, err := range peerCalls(t, r, tc.conn) {
				if got := status.Code(err); got != tc.want && !(tc.want == codes.OK && call == "inspect" && got == codes.NotFound) {
					t.Errorf("%s: %v (%s), want %s", call, err, got, tc.want)
				}
			}
		})
	}
	// An Envoy on the peer port, even with the tier's certificate.
	st, err := discovery.NewAggregatedDiscoveryServiceClient(dialWith(peerAddr, good)).DeltaAggregatedResources(context.Background())
	if err == nil {
		st.Send(&discovery.DeltaDiscoveryRequest{Node: node("ns1", "app", 1), TypeUrl: xds.TypeCluster})
		_, err = st.Recv()
	}
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("Envoy stream on the peer port: %v, want PermissionDenied", err)
	}
}

// withoutCertificate returns tc presenting no client certificate.
func withoutCertificate(tc *tls.Config) *tls.Config {
	tc = tc.Clone()
	tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return new(tls.Certificate), nil }
	return tc
}
