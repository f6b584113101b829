package relay

import (
	"context"
	"crypto/tls"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/ledger/ledgerpb"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// methodDelta is the full name of the Delta ADS stream relays open to a
// key's owner.
const methodDelta = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"

// deltaProof is relay id's proof of a Delta stream for key.
func deltaProof(secret []byte, id, key string) string {
	return peers.Prover{Secret: secret, ID: id}.Proof(methodDelta, key)
}

// dialPeer dials addr as a relay's pool does: every call whose context
// has a Prover (Relay.asPeer) carries a fresh proof.
func dialPeer(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, append(peers.ProofOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestPeerProofNotReplayable: in a tier without mTLS between relays, the
// proof a relay-to-relay stream or call carries is good for that one
// call: read off the wire, it is refused again, later, and for another
// key or method. A relay of the tier (its pool) proves each call anew.
func TestPeerProofNotReplayable(t *testing.T) {
	r, conn, secret, n := secretTierRelay(t)
	const key = peerNamedKey
	as := func(id, proof string, kv ...string) []string {
		return append([]string{peers.MDRelay, id, peers.MDAuth, proof}, kv...)
	}
	stream := func(t *testing.T, kv []string) codes.Code {
		t.Helper()
		return status.Code(firstResponseErr(t, mdConn{conn, kv}, n))
	}
	call := func(t *testing.T, kv []string) codes.Code {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := ledgerpb.NewLedgerClient(conn).GetSummary(metadata.AppendToOutgoingContext(ctx, kv...), &ledgerpb.SummaryRequest{Brief: true})
		return status.Code(err)
	}

	t.Run("replayed stream", func(t *testing.T) {
		captured := as("relay-b", deltaProof(secret, "relay-b", key), peers.MDKey, key)
		if got := stream(t, captured); got != codes.OK {
			t.Fatalf("first use: %v, want OK", got)
		}
		if got := stream(t, captured); got != codes.Unauthenticated {
			t.Fatalf("replayed: %v, want Unauthenticated", got)
		}
	})
	t.Run("replayed call", func(t *testing.T) {
		captured := as("relay-b", peers.Prover{Secret: secret, ID: "relay-b"}.Proof(ledgerpb.Ledger_GetSummary_FullMethodName, ""))
		if got := call(t, captured); got != codes.OK {
			t.Fatalf("first use: %v, want OK", got)
		}
		if got := call(t, captured); got != codes.Unauthenticated {
			t.Fatalf("replayed: %v, want Unauthenticated", got)
		}
	})
	t.Run("expired", func(t *testing.T) {
		past := func() time.Time { return time.Now().Add(-peers.Window - time.Minute) }
		old := peers.Prover{Secret: secret, ID: "relay-b", Now: past}
		if got := stream(t, as("relay-b", old.Proof(methodDelta, key), peers.MDKey, key)); got != codes.Unauthenticated {
			t.Errorf("stream: %v, want Unauthenticated", got)
		}
		if got := call(t, as("relay-b", old.Proof(ledgerpb.Ledger_GetSummary_FullMethodName, ""))); got != codes.Unauthenticated {
			t.Errorf("call: %v, want Unauthenticated", got)
		}
	})
	t.Run("for another key", func(t *testing.T) {
		if got := stream(t, as("relay-b", deltaProof(secret, "relay-b", "another-key"), peers.MDKey, key)); got != codes.Unauthenticated {
			t.Errorf("%v, want Unauthenticated", got)
		}
	})
	t.Run("for another method", func(t *testing.T) {
		p := peers.Prover{Secret: secret, ID: "relay-b"}
		sotw := "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
		if got := stream(t, as("relay-b", p.Proof(sotw, key), peers.MDKey, key)); got != codes.Unauthenticated {
			t.Errorf("a SotW stream's proof on a Delta stream: %v, want Unauthenticated", got)
		}
		if got := call(t, as("relay-b", p.Proof(inspectpb.Inspect_GetKey_FullMethodName, ""))); got != codes.Unauthenticated {
			t.Errorf("an inspect call's proof on a ledger call: %v, want Unauthenticated", got)
		}
		if got := call(t, as("relay-b", p.Proof(methodDelta, ""))); got != codes.Unauthenticated {
			t.Errorf("a stream's proof on a ledger call: %v, want Unauthenticated", got)
		}
	})
	t.Run("version 1 token", func(t *testing.T) {
		// HMAC(secret, id), as relays before this version sent it.
		if got := stream(t, as("relay-b", "4c1f0e4b5b0f3f9f9a0c8d1d2e3f405162738495a6b7c8d9eafb0c1d2e3f4051", peers.MDKey, key)); got != codes.Unauthenticated {
			t.Errorf("%v, want Unauthenticated", got)
		}
	})
	t.Run("a relay of the tier", func(t *testing.T) {
		// One context, many calls and streams: each proves itself anew.
		pc := dialPeer(t, r.Addr().String())
		b := &Relay{cfg: Config{ID: "relay-b", Tier: TierConfig{Secret: secret}}}
		ctx, cancel := context.WithTimeout(b.asPeer(context.Background()), 10*time.Second)
		defer cancel()
		for i := range 3 {
			if _, err := ledgerpb.NewLedgerClient(pc).GetSummary(ctx, &ledgerpb.SummaryRequest{Brief: true}); err != nil {
				t.Fatalf("ledger call %d: %v", i, err)
			}
			st, err := discovery.NewAggregatedDiscoveryServiceClient(pc).DeltaAggregatedResources(metadata.AppendToOutgoingContext(ctx, peers.MDKey, string(aggkey.Istio{}.Key(n))))
			if err == nil {
				st.Send(&discovery.DeltaDiscoveryRequest{Node: n, TypeUrl: xds.TypeCluster})
				_, err = st.Recv()
			}
			if err != nil {
				t.Fatalf("stream %d: %v", i, err)
			}
		}
	})
}

// TestPeerPortWantsAVerifiedCertificate: whatever Tier.TLS asks of
// clients, a relay-to-relay call on the peer port is refused unless it
// came with a client certificate the handshake verified: a config that
// only requests one, or verifies one only if given, admits no call
// without one, nor with one nothing checked (real TLS over loopback).
func TestPeerPortWantsAVerifiedCertificate(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	seed(up, "ns1", 2)
	tierCA, otherCA := authtest.NewCA(t, "tier root"), authtest.NewCA(t, "other root")
	_, good := peerTLS(t, tierCA, tierCA, tierID)
	_, wrongRoot := peerTLS(t, otherCA, tierCA, tierID)
	noCert := withoutCertificate(good)
	pair, roots := peerKeys(t, tierCA, tierCA, tierID)
	for _, tc := range []struct {
		name   string
		server *tls.Config
		client *tls.Config
		want   codes.Code
	}{
		{"requested, none given", tlsfiles.ServerConfig(pair, roots, tls.RequestClientCert), noCert, codes.Unauthenticated},
		{"requested, another CA's given", tlsfiles.ServerConfig(pair, roots, tls.RequestClientCert), wrongRoot, codes.Unauthenticated},
		{"verified if given, none given", tlsfiles.ServerConfig(pair, roots, tls.VerifyClientCertIfGiven), noCert, codes.Unauthenticated},
		{"verified if given, another CA's given", tlsfiles.ServerConfig(pair, roots, tls.VerifyClientCertIfGiven), wrongRoot, codes.Unavailable},
		{"verified if given, the tier's given", tlsfiles.ServerConfig(pair, roots, tls.VerifyClientCertIfGiven), good, codes.OK},
		{"not requested", tlsfiles.ServerConfig(pair, nil, tls.NoClientCert), good, codes.Unauthenticated},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := startRelay(t, up, func(c *Config) {
				c.Tier.Listen = "127.0.0.1:0"
				c.Tier.TLS = tc.server
				c.Tier.Secret = []byte("the tier's secret") // no help on the peer port
			})
			conn, err := grpc.NewClient(r.peerLis.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(tc.client)))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			for call, err := range peerCalls(t, r, conn) {
				if got := status.Code(err); got != tc.want && !(tc.want == codes.OK && call == "inspect" && got == codes.NotFound) {
					t.Errorf("%s: %v (%s), want %s", call, err, got, tc.want)
				}
			}
		})
	}
}
