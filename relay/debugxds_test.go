package relay

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	adminv3 "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	cluster "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statusv3 "github.com/envoyproxy/go-control-plane/envoy/service/status/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/istiodebug"
	"github.com/meshrelay/meshrelay/relay/peers"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// allowEveryone authorizes every stream, as AllowAll does, but is an
// Authorizer of its own: the relay cannot know it trusts the port.
type allowEveryone struct{}

func (allowEveryone) Authorize(context.Context, *core.Node) error { return nil }

// TestDebugTypes: istiod's debug type URLs are answered by the relay
// itself on a trusted port, once per request (an ACK is not answered
// again), without the debug stream joining a key; with an Authorizer they
// are refused.
func TestDebugTypes(t *testing.T) {
	e := newEnv(t, false, nil)
	c := e.client(0)
	syncAll(c)
	e.waitLedger(t, "the client's ACKs", ledger.Convergence{Envoys: 1, Current: 1}, "")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	debugNode := &core.Node{Id: "debug~0.0.0.0~istioctl~.svc.cluster.local"}
	ads, err := discovery.NewAggregatedDiscoveryServiceClient(e.conn).StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ads.Send(&discovery.DiscoveryRequest{TypeUrl: istiodebug.TypeSyncz, Node: debugNode}); err != nil {
		t.Fatal(err)
	}
	syncz, err := ads.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var cc statusv3.ClientConfig
	if len(syncz.GetResources()) != 1 || syncz.GetResources()[0].UnmarshalTo(&cc) != nil || cc.GetNode().GetId() != node("ns1", "app", 0).GetId() {
		t.Fatalf("syncz = %v, want the one client", syncz)
	}
	// istioctl's columns and its namespace filter read the node's
	// metadata: the relay gives what the Envoy's node gave.
	md := cc.GetNode().GetMetadata().GetFields()
	for name, want := range map[string]string{"NAMESPACE": "ns1", "CLUSTER_ID": "Kubernetes", "ISTIO_VERSION": "1.28.0"} {
		if got := md[name].GetStringValue(); got != want {
			t.Errorf("syncz: node metadata %s = %q, want %q", name, got, want)
		}
	}
	// As istiod's: the types the client subscribed to, by type URL, each
	// SYNCED once ACKed.
	var types []string
	for _, gc := range cc.GetGenericXdsConfigs() {
		types = append(types, gc.GetTypeUrl())
		if gc.GetConfigStatus() != statusv3.ConfigStatus_SYNCED {
			t.Errorf("syncz: %s is %s, want SYNCED", gc.GetTypeUrl(), gc.GetConfigStatus())
		}
	}
	if want := sorted([]string{xds.TypeCluster, xds.TypeEndpoint, xds.TypeListener, xds.TypeRoute}); !slices.Equal(types, want) {
		t.Fatalf("syncz lists types %q, want the four the client subscribed to, %q", types, want)
	}
	// The ACK is not answered: the next answer is the next question's.
	ack := &discovery.DiscoveryRequest{TypeUrl: istiodebug.TypeSyncz, ResponseNonce: syncz.GetNonce(), VersionInfo: syncz.GetVersionInfo()}
	dump := &discovery.DiscoveryRequest{TypeUrl: istiodebug.TypeConfigDump, ResourceNames: []string{node("ns1", "app", 0).GetId()}}
	if err := ads.Send(ack); err != nil {
		t.Fatal(err)
	}
	if err := ads.Send(dump); err != nil {
		t.Fatal(err)
	}
	got, err := ads.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if got.GetTypeUrl() != istiodebug.TypeConfigDump || len(got.GetResources()) == 0 {
		t.Fatalf("after an ACK and a config_dump request, got %s with %d resources; want the dump", got.GetTypeUrl(), len(got.GetResources()))
	}
	if n := len(e.r.Clients()); n != 1 {
		t.Fatalf("the relay lists %d clients, want 1: the debug stream joined a key", n)
	}

	guarded := newEnv(t, false, func(cfg *Config) { cfg.XDS.Authorizer = allowEveryone{} })
	ads2, err := discovery.NewAggregatedDiscoveryServiceClient(guarded.conn).StreamAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := ads2.Send(&discovery.DiscoveryRequest{TypeUrl: istiodebug.TypeSyncz, Node: debugNode}); err != nil {
		t.Fatal(err)
	}
	if _, err := ads2.Recv(); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("syncz with an Authorizer: %v, want PermissionDenied", err)
	}
}

// TestDebugTypesWithIstioClientNonces: Istio's ADS client (pkg/adsc,
// istioctl's) puts a nonce of its own, a timestamp, on every request, its
// first included, and never ACKs a debug answer. Each such request is a
// question and is answered, as istiod answers; a request naming the
// stream's last answer of its type (an ACK, with the same names; a NACK)
// is not answered again, SotW and Delta alike.
func TestDebugTypesWithIstioClientNonces(t *testing.T) {
	e := newEnv(t, false, nil)
	c := e.client(0)
	syncAll(c)
	e.waitLedger(t, "the client's ACKs", ledger.Convergence{Envoys: 1, Current: 1}, "")
	envoy := node("ns1", "app", 0).GetId()
	debugNode := &core.Node{Id: "istioctl-1~0.0.0.0~istioctl-1.istio-system~istio-system.svc.cluster.local"}
	stamp := func() string { return time.Now().String() } // as adsc.Send
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ads := discovery.NewAggregatedDiscoveryServiceClient(e.conn)

	t.Run("SotW", func(t *testing.T) {
		st, err := ads.StreamAggregatedResources(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ask := func(req *discovery.DiscoveryRequest) *discovery.DiscoveryResponse {
			t.Helper()
			return askOn(t, st.Send, st.Recv, req)
		}
		first := ask(&discovery.DiscoveryRequest{TypeUrl: istiodebug.TypeSyncz, Node: debugNode, ResponseNonce: stamp()})
		if got := synczNodes(t, first); !slices.Equal(got, []string{envoy}) {
			t.Fatalf("syncz lists %q, want the one Envoy", got)
		}
		ask(&discovery.DiscoveryRequest{TypeUrl: istiodebug.TypeSyncz, ResponseNonce: stamp()})
		dump := ask(&discovery.DiscoveryRequest{TypeUrl: istiodebug.TypeConfigDump, ResourceNames: []string{envoy}, ResponseNonce: stamp()})
		if len(dumpClusters(t, dump)) == 0 {
			t.Fatal("config_dump with a client's own nonce: no clusters")
		}
		// An ACK and a NACK of the dump are not answered: the next answer
		// is the next question's.
		for _, ack := range []*discovery.DiscoveryRequest{
			{TypeUrl: istiodebug.TypeConfigDump, ResourceNames: []string{envoy}, ResponseNonce: dump.GetNonce(), VersionInfo: dump.GetVersionInfo()},
			{TypeUrl: istiodebug.TypeConfigDump, ResourceNames: []string{envoy}, ResponseNonce: dump.GetNonce(), ErrorDetail: &rpcstatus.Status{Message: "no"}},
		} {
			if err := st.Send(ack); err != nil {
				t.Fatal(err)
			}
		}
		ask(&discovery.DiscoveryRequest{TypeUrl: istiodebug.TypeSyncz, ResponseNonce: stamp()})
	})

	t.Run("Delta", func(t *testing.T) {
		st, err := ads.DeltaAggregatedResources(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ask := func(req *discovery.DeltaDiscoveryRequest) *discovery.DeltaDiscoveryResponse {
			t.Helper()
			return askOn(t, st.Send, st.Recv, req)
		}
		first := ask(&discovery.DeltaDiscoveryRequest{TypeUrl: istiodebug.TypeSyncz, Node: debugNode, ResponseNonce: stamp()})
		if len(first.GetResources()) != 1 {
			t.Fatalf("syncz lists %d Envoys, want 1", len(first.GetResources()))
		}
		dump := ask(&discovery.DeltaDiscoveryRequest{TypeUrl: istiodebug.TypeConfigDump, ResourceNamesSubscribe: []string{envoy}, ResponseNonce: stamp()})
		if len(dump.GetResources()) == 0 {
			t.Fatal("config_dump with a client's own nonce: nothing")
		}
		if err := st.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: istiodebug.TypeConfigDump, ResponseNonce: dump.GetNonce()}); err != nil {
			t.Fatal(err)
		}
		ask(&discovery.DeltaDiscoveryRequest{TypeUrl: istiodebug.TypeSyncz, ResponseNonce: stamp()})
	})
}

// typed is a request or response of an xDS type.
type typed interface{ GetTypeUrl() string }

// askOn sends req on a stream (SotW or Delta) and returns the next answer,
// which must be of req's type.
func askOn[Req, Resp typed](t *testing.T, send func(Req) error, recv func() (Resp, error), req Req) Resp {
	t.Helper()
	if err := send(req); err != nil {
		t.Fatal(err)
	}
	resp, err := recv()
	if err != nil {
		t.Fatalf("%s: %v", req.GetTypeUrl(), err)
	}
	if resp.GetTypeUrl() != req.GetTypeUrl() {
		t.Fatalf("asked %s, answered %s", req.GetTypeUrl(), resp.GetTypeUrl())
	}
	return resp
}

// debugAsk asks one debug question over a SotW stream of conn, with token
// if set, and returns the answer or the stream's error.
func debugAsk(t *testing.T, conn *grpc.ClientConn, token string, req *discovery.DiscoveryRequest) (*discovery.DiscoveryResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	ads, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
	if err != nil {
		return nil, err
	}
	req.Node = &core.Node{Id: "debug~0.0.0.0~istioctl~.svc.cluster.local"}
	if err := ads.Send(req); err != nil {
		_ = err // the refusal comes back on Recv
	}
	return ads.Recv()
}

// synczNodes returns the node ids a syncz answer lists, sorted.
func synczNodes(t *testing.T, resp *discovery.DiscoveryResponse) []string {
	t.Helper()
	var ids []string
	for _, a := range resp.GetResources() {
		var cc statusv3.ClientConfig
		if err := a.UnmarshalTo(&cc); err != nil {
			t.Fatalf("syncz resource: %v", err)
		}
		ids = append(ids, cc.GetNode().GetId())
	}
	slices.Sort(ids)
	return ids
}

// dumpClusters returns the names of the dynamic clusters of a config_dump
// answer, sorted.
func dumpClusters(t *testing.T, resp *discovery.DiscoveryResponse) []string {
	t.Helper()
	var names []string
	for _, a := range resp.GetResources() {
		var cd adminv3.ClustersConfigDump
		if a.MessageIs(&cd) {
			if err := a.UnmarshalTo(&cd); err != nil {
				t.Fatal(err)
			}
			for _, c := range cd.GetDynamicActiveClusters() {
				var cl cluster.Cluster
				if err := c.GetCluster().UnmarshalTo(&cl); err != nil {
					t.Fatal(err)
				}
				names = append(names, cl.GetName())
			}
		}
	}
	slices.Sort(names)
	return names
}

// TestDebugTypesOnTLSPort: istioctl's debug questions over the TLS port,
// proven by a JWT or a SPIFFE certificate. An admin identity is answered
// for the tier; another identity for its own namespace: syncz lists its
// namespace's Envoys alone, a config dump of one of them is answered, one
// of another namespace is PermissionDenied (whatever exists), one of its
// namespace not on the tier is an empty answer (as istiod's), and so is one
// whose id names no namespace but whose key is another's. A stream
// that proves nothing is refused on admission; a TLS port that
// authenticates no one answers no debug question.
func TestDebugTypesOnTLSPort(t *testing.T) {
	e := newSecureEnv(t, auth.ModeAny, func(c *Config) {
		c.Admin.Identities, c.Admin.DebugNamespaces = []string{adminID}, []string{"istio-system"}
	})
	// The last names its namespace in its metadata alone: its id names
	// none.
	anon := saNode("ns2", "app", 3)
	anon.Id = "sidecar~10.0.0.4~app-3~local"
	envoys := []*core.Node{saNode("ns1", "app", 1), saNode("ns1", "app", 2), saNode("ns2", "app", 1), anon}
	for _, n := range envoys {
		tok := e.issuer.Sign(t, authtest.Token{Namespace: auth.ConfigNamespace(n), ServiceAccount: "app"})
		if _, err := firstAnswer(t, e.dial(t, creds{token: tok}), tok, n); err != nil {
			t.Fatalf("Envoy %s: %v", n.GetId(), err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for len(e.r.TierLedger(ctx, ledger.Scope{}, ledger.Full).Envoys()) != len(envoys) {
		if ctx.Err() != nil {
			t.Fatal("the ledger never listed the Envoys")
		}
		time.Sleep(20 * time.Millisecond)
	}
	ns1 := []string{envoys[0].GetId(), envoys[1].GetId()}
	all := append(slices.Clone(ns1), envoys[2].GetId(), anon.GetId())
	adminTok := e.issuer.Sign(t, authtest.Token{Namespace: "istio-system", ServiceAccount: "istioctl"})
	ns1Tok := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "viewer"})
	// istioctl's own choice: istio-system's default account.
	istioctlTok := e.issuer.Sign(t, authtest.Token{Namespace: "istio-system", ServiceAccount: "default"})
	adminCert := e.mesh.Workload(t, "cluster.local", "istio-system", "istioctl")
	ns2Cert := e.mesh.Workload(t, "cluster.local", "ns2", "ops")
	syncz := &discovery.DiscoveryRequest{TypeUrl: istiodebug.TypeSyncz}
	dump := func(id string) *discovery.DiscoveryRequest {
		return &discovery.DiscoveryRequest{TypeUrl: istiodebug.TypeConfigDump, ResourceNames: []string{id}}
	}
	clusters := []string{"c0", "c1", "c2"}
	for _, tc := range []struct {
		name     string
		creds    creds
		req      *discovery.DiscoveryRequest
		code     codes.Code
		nodes    []string // syncz: the node ids listed
		clusters []string // config_dump: the clusters dumped
	}{
		{"admin JWT, syncz", creds{token: adminTok}, syncz, codes.OK, all, nil},
		{"admin certificate, syncz", creds{cert: adminCert}, syncz, codes.OK, all, nil},
		{"istioctl's JWT (a debug namespace), syncz", creds{token: istioctlTok}, syncz, codes.OK, all, nil},
		{"istioctl's JWT (a debug namespace), dump of ns2", creds{token: istioctlTok}, dump(envoys[2].GetId()), codes.OK, nil, clusters},
		{"ns1 JWT, syncz", creds{token: ns1Tok}, syncz, codes.OK, ns1, nil},
		{"ns2 certificate, syncz", creds{cert: ns2Cert}, syncz, codes.OK, []string{anon.GetId(), envoys[2].GetId()}, nil},
		{"admin JWT, dump of ns2", creds{token: adminTok}, dump(envoys[2].GetId()), codes.OK, nil, clusters},
		{"ns1 JWT, dump of ns1", creds{token: ns1Tok}, dump(envoys[1].GetId()), codes.OK, nil, clusters},
		{"ns1 JWT, dump of ns2", creds{token: ns1Tok}, dump(envoys[2].GetId()), codes.PermissionDenied, nil, nil},
		{"ns1 JWT, dump of ns2 not on the tier", creds{token: ns1Tok}, dump(saNode("ns2", "app", 9).GetId()), codes.PermissionDenied, nil, nil},
		{"ns1 JWT, dump of ns1 not on the tier", creds{token: ns1Tok}, dump(saNode("ns1", "app", 9).GetId()), codes.OK, nil, nil},
		{"ns2 certificate, dump of ns1", creds{cert: ns2Cert}, dump(envoys[0].GetId()), codes.PermissionDenied, nil, nil},
		{"ns2 certificate, dump of ns2 by an id naming none", creds{cert: ns2Cert}, dump(anon.GetId()), codes.OK, nil, clusters},
		{"ns1 JWT, dump of ns2 by an id naming none", creds{token: ns1Tok}, dump(anon.GetId()), codes.OK, nil, nil},
		{"nothing, syncz", creds{}, syncz, codes.Unauthenticated, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := debugAsk(t, e.dial(t, tc.creds), tc.creds.token, tc.req)
			if status.Code(err) != tc.code {
				t.Fatalf("%s: %v, want %s", tc.req.GetTypeUrl(), err, tc.code)
			}
			if err != nil {
				return
			}
			if tc.req.GetTypeUrl() == istiodebug.TypeSyncz {
				if got, want := synczNodes(t, resp), slices.Sorted(slices.Values(tc.nodes)); !slices.Equal(got, want) {
					t.Fatalf("syncz lists %q, want %q", got, want)
				}
				return
			}
			if got := dumpClusters(t, resp); !slices.Equal(got, tc.clusters) {
				t.Fatalf("config_dump holds clusters %q, want %q", got, tc.clusters)
			}
		})
	}
	if n := len(e.r.Clients()); n != len(envoys) {
		t.Fatalf("the relay lists %d clients, want %d: a debug stream joined a key", n, len(envoys))
	}

	t.Run("no authentication on the TLS port", func(t *testing.T) {
		open := newSecureEnv(t, auth.ModeAny, func(c *Config) { c.XDS.Authenticator = nil })
		_, err := debugAsk(t, open.dial(t, creds{}), "", syncz)
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "proved an identity") {
			t.Fatalf("syncz on a TLS port without authentication: %v, want PermissionDenied saying why", err)
		}
	})
}

// TestDebugTypesOnPeerPort: the peer port answers no debug question,
// neither from a relay of the tier (proven by its certificate) nor from
// a client that is none.
func TestDebugTypesOnPeerPort(t *testing.T) {
	up := newTestUpstream(t, "ns1")
	seed(up, "ns1", 2)
	ca := authtest.NewCA(t, "tier root")
	server, client := peerTLS(t, ca, ca, tierID)
	r := startRelay(t, up, func(c *Config) { c.Tier.Listen, c.Tier.TLS = "127.0.0.1:0", server })
	conn, err := grpc.NewClient(r.peerLis.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(client)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	asRelay := metadata.Pairs(peers.MDRelay, "relay-x", peers.MDKey, string(aggkey.Istio{}.Key(node("ns1", "app", 1))))
	for _, tc := range []struct {
		name string
		md   metadata.MD
		msg  string
	}{
		{"a relay of the tier", asRelay, "not answered on the peer port"},
		{"not a relay", nil, "serves the tier's relays only"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(metadata.NewOutgoingContext(context.Background(), tc.md), 10*time.Second)
			defer cancel()
			ads, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
			if err == nil {
				ads.Send(&discovery.DiscoveryRequest{TypeUrl: istiodebug.TypeSyncz, Node: &core.Node{Id: "debug~0.0.0.0~istioctl~.svc.cluster.local"}})
				_, err = ads.Recv()
			}
			if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("syncz on the peer port: %v, want PermissionDenied, %q", err, tc.msg)
			}
		})
	}
}
