package shard_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	envoyadmin "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	inproc "github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
	"github.com/meshrelay/meshrelay/relay/inspectpb"
	"github.com/meshrelay/meshrelay/relay/tlsfiles"
	"github.com/meshrelay/meshrelay/shard"
	"github.com/meshrelay/meshrelay/shard/adminpb"
	"github.com/meshrelay/meshrelay/shard/shardtest"
)

// TestAdminAccessAndDrain: a tier whose admin listeners serve mTLS and want
// a bearer token, every relay but relay-2 allowing mutating calls. Without
// a client certificate nothing is reached; without the token only health
// is; pprof wants the token too. Drain is refused by a read-only relay and
// by a relay the request does not name; draining relay-1 through its own
// admin address (found in the ring) takes it out of the ring and moves its
// Envoys to the others, with nothing lost.
func TestAdminAccessAndDrain(t *testing.T) {
	const token = "s3cret-admin-token"
	certs := shardtest.NewCerts(t)
	ctx := context.Background()
	sc := upstream.Scenario{Services: 6, Endpoints: 6, Namespaces: 3, LocalFraction: 0}
	up := startUpstream(t, sc)
	tier, err := inproc.StartConvergedTier(ctx, inproc.TierConfig{Relays: 3, Upstream: up.Addr(), Logger: testLogger(),
		DrainPeriod: 500 * time.Millisecond,
		Relay: func(c *relay.Config) {
			c.Admin.Listen, c.Admin.TLS, c.Admin.Token = "127.0.0.1:0", certs.Server, token
		},
		Node: func(c *shard.NodeConfig) { c.AllowMutations = c.Relay.ID != "relay-2" },
	}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tier.Stop(context.Background()) })
	fleet, err := traffic.StartFleet(ctx, traffic.FleetConfig{Scenario: sc, Envoys: 30, Keys: 3, Protocol: envoy.Delta, Target: tier.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fleet.Stop(context.Background()) })
	relays := tier.Running()
	adminOf := func(i int) string { return relays[i].Node.Relay().AdminAddr().String() }

	dial := func(t *testing.T, addr string, creds credentials.TransportCredentials) *grpc.ClientConn {
		t.Helper()
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	withToken := func(ctx context.Context) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
	defer rcancel()

	t.Run("no client certificate", func(t *testing.T) {
		conn := dial(t, adminOf(0), credentials.NewTLS(&tls.Config{RootCAs: certs.Client.RootCAs}))
		_, err := adminpb.NewAdminClient(conn).GetRing(withToken(rctx), &adminpb.GetRingRequest{})
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("GetRing without a client certificate: %v, want Unavailable (handshake refused)", err)
		}
		plain := dial(t, adminOf(0), insecure.NewCredentials())
		if _, err := adminpb.NewAdminClient(plain).GetRing(withToken(rctx), &adminpb.GetRingRequest{}); status.Code(err) != codes.Unavailable {
			t.Fatalf("GetRing in cleartext: %v, want Unavailable", err)
		}
	})

	conns := make([]*grpc.ClientConn, len(relays))
	for i := range relays {
		conns[i] = dial(t, adminOf(i), credentials.NewTLS(certs.Client))
	}
	client := func(i int) adminpb.AdminClient { return adminpb.NewAdminClient(conns[i]) }

	t.Run("token", func(t *testing.T) {
		if _, err := client(0).GetRing(rctx, &adminpb.GetRingRequest{}); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("GetRing without the token: %v, want Unauthenticated", err)
		}
		bad := metadata.AppendToOutgoingContext(rctx, "authorization", "Bearer "+token+"x")
		if _, err := client(0).GetRing(bad, &adminpb.GetRingRequest{}); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("GetRing with a wrong token: %v, want Unauthenticated", err)
		}
		h, err := healthpb.NewHealthClient(conns[0]).Check(rctx, &healthpb.HealthCheckRequest{})
		if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health without the token = %v, %v; want SERVING (probes carry no token)", h, err)
		}
		ring, err := client(0).GetRing(withToken(rctx), &adminpb.GetRingRequest{})
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range ring.GetMembers() {
			i := int(m.GetName()[len("relay-")] - '0')
			if m.GetAdminAddress() != adminOf(i) {
				t.Errorf("member %s: admin address %q, want %q", m.GetName(), m.GetAdminAddress(), adminOf(i))
			}
		}
	})

	t.Run("pprof", func(t *testing.T) {
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: certs.Client}, Timeout: 10 * time.Second}
		for _, tc := range []struct {
			auth string
			want int
		}{{"", http.StatusUnauthorized}, {"Bearer nope", http.StatusUnauthorized}, {"Bearer " + token, http.StatusOK}} {
			req, _ := http.NewRequestWithContext(rctx, http.MethodGet, "https://"+adminOf(0)+"/debug/pprof/", nil)
			if tc.auth != "" {
				req.Header.Set("Authorization", tc.auth)
			}
			resp, err := hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tc.want {
				t.Errorf("GET /debug/pprof/ with %q: %d, want %d", tc.auth, resp.StatusCode, tc.want)
			}
		}
	})

	// Every Envoy connected before the drain.
	waitLedger(t, "30 Envoys current", func() (bool, string) {
		c, err := client(0).GetConvergence(withToken(rctx), &adminpb.ConvergenceRequest{})
		if err != nil {
			return false, err.Error()
		}
		return c.GetTier().GetEnvoys() == 30 && c.GetTier().GetCurrent() == 30 && len(c.GetMissing()) == 0, fmt.Sprint(c.GetTier())
	})
	before := relays[1].Node.Relay().Stats().Streams

	t.Run("drain refused", func(t *testing.T) {
		if _, err := client(2).Drain(withToken(rctx), &adminpb.DrainRequest{Relay: "relay-2"}); status.Code(err) != codes.PermissionDenied {
			t.Fatalf("Drain of read-only relay-2: %v, want PermissionDenied", err)
		}
		if _, err := client(0).Drain(withToken(rctx), &adminpb.DrainRequest{Relay: "relay-1"}); status.Code(err) != codes.FailedPrecondition {
			t.Fatalf("Drain of relay-1 asked of relay-0: %v, want FailedPrecondition", err)
		}
		if !relays[0].Node.Relay().Ready() || !relays[2].Node.Relay().Ready() {
			t.Fatal("a refused Drain left a relay not ready")
		}
	})

	t.Run("drain", func(t *testing.T) {
		got, err := client(1).Drain(withToken(rctx), &adminpb.DrainRequest{Relay: "relay-1"})
		if err != nil {
			t.Fatal(err)
		}
		if got.GetRelay() != relays[1].Node.Ring().Name() || got.GetStreams() < int64(before) || got.GetAlready() ||
			got.GetPeriod().AsDuration() != 500*time.Millisecond {
			t.Fatalf("Drain = %v; want relay %s, ≥ %d streams, period 500ms", got, relays[1].Node.Ring().Name(), before)
		}
		again, err := client(1).Drain(withToken(rctx), &adminpb.DrainRequest{Relay: relays[1].Node.Ring().Name()})
		if err != nil || !again.GetAlready() {
			t.Fatalf("second Drain = %v, %v; want already draining", again, err)
		}
		h, err := healthpb.NewHealthClient(conns[1]).Check(rctx, &healthpb.HealthCheckRequest{})
		if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Fatalf("health of the drained relay = %v, %v; want NOT_SERVING", h, err)
		}
		waitLedger(t, "relay-1 out of the ring, its Envoys on the others, all current", func() (bool, string) {
			ring, err := client(0).GetRing(withToken(rctx), &adminpb.GetRingRequest{})
			if err != nil {
				return false, err.Error()
			}
			c, err := client(0).GetConvergence(withToken(rctx), &adminpb.ConvergenceRequest{})
			if err != nil {
				return false, err.Error()
			}
			streams := relays[1].Node.Relay().Stats().Streams
			return len(ring.GetMembers()) == 2 && streams == 0 && c.GetTier().GetEnvoys() == 30 && c.GetTier().GetCurrent() == 30 &&
					c.GetByRelay()["relay-1"].GetEnvoys() == 0,
				fmt.Sprintf("%d members, relay-1 has %d streams, tier %v by relay %v", len(ring.GetMembers()), streams, c.GetTier(), c.GetByRelay())
		})
		for _, e := range fleet.Envoys() {
			if v := e.Violations(); len(v) > 0 {
				t.Errorf("Envoy %s: %v", e.ID(), v)
			}
		}
	})
}

// scopeCaller is one caller of TestAdminScopes: a connection (with its
// client certificate, if any) and the bearer token it sends (if any).
type scopeCaller struct {
	name  string
	conn  *grpc.ClientConn
	token string
	// sees is the namespace whose Envoys it sees; "" for all (an admin).
	sees string
	// code is what every call but health gets if not OK (unauthenticated).
	code codes.Code
}

func (c scopeCaller) ctx(ctx context.Context) context.Context {
	if c.token == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.token)
}

func (c scopeCaller) client() adminpb.AdminClient { return adminpb.NewAdminClient(c.conn) }

// TestAdminScopes: a tier whose admin API proves its callers with the
// static token, service-account JWTs or SPIFFE client certificates, one
// identity an admin, and mutations allowed. Nine Envoys, three in each of
// ns-0, ns-1 and ns-2 (one key each); one Envoy of ns-0 has left. Every RPC
// of the admin API is asked by every caller: admins see the tier, a caller
// of a namespace sees exactly its namespace's Envoys and keys (its
// convergence, stragglers and waits are its own), is refused another
// namespace's node, key or config, and may not drain; a caller that
// proves nothing gets nothing.
func TestAdminScopes(t *testing.T) {
	const token = "static-admin-token"
	const adminID = "spiffe://cluster.local/ns/istio-system/sa/istioctl"
	ctx := context.Background()
	mesh, issuer := authtest.NewCA(t, "mesh root"), authtest.NewIssuer(t)
	pair, err := tlsfiles.LoadKeyPair(mesh.Serving(t).Write(t, ""))
	if err != nil {
		t.Fatal(err)
	}
	roots, err := tlsfiles.LoadCAPool(mesh.WriteRoot(t))
	if err != nil {
		t.Fatal(err)
	}
	lcfg := auth.DefaultLocalConfig()
	lcfg.Issuer, lcfg.Keys = issuer.URL, auth.KeysFromFile(issuer.WriteJWKS(t))
	local, err := auth.NewLocal(ctx, lcfg)
	if err != nil {
		t.Fatal(err)
	}
	authn, err := auth.NewAuthenticator(auth.ModeAny, &auth.CertVerifier{TrustDomain: "cluster.local", Roots: roots.Certificates}, local)
	if err != nil {
		t.Fatal(err)
	}
	sc := upstream.Scenario{Services: 6, Endpoints: 6, Namespaces: 3, LocalFraction: 0}
	up := startUpstream(t, sc)
	// No balancing: the answers asserted below are of a tier at rest, and
	// a relay holding more than its share moves settled Envoys away once
	// they are three rounds old, making them stragglers while they
	// reconnect.
	tier, err := inproc.StartConvergedTier(ctx, inproc.TierConfig{Relays: 2, Upstream: up.Addr(), Logger: testLogger(),
		BalanceInterval: time.Hour,
		Relay: func(c *relay.Config) {
			c.Admin.Listen, c.Admin.Token = "127.0.0.1:0", token
			c.Admin.TLS = tlsfiles.ServerConfig(pair, roots, tls.VerifyClientCertIfGiven, "h2", "http/1.1")
			c.Admin.Authenticator, c.Admin.Identities = authn, []string{adminID}
		},
		Node: func(c *shard.NodeConfig) { c.AllowMutations = true },
	}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tier.Stop(context.Background()) })
	fleet, err := traffic.StartFleet(ctx, traffic.FleetConfig{Scenario: sc, Envoys: 9, Keys: 3, Protocol: envoy.Delta, Target: tier.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fleet.Stop(context.Background()) })
	// Envoy i is of namespace ns-<i%3>.
	byNS := map[string][]string{}
	for i, e := range fleet.Envoys() {
		ns := upstream.NamespaceName(i % 3)
		byNS[ns] = append(byNS[ns], e.ID())
	}
	gone := fleet.Envoys()[0].ID()

	relays := tier.Running()
	admin := relays[0].Node.Relay().AdminAddr().String()
	dial := func(cert *authtest.Issued) *grpc.ClientConn {
		tc := &tls.Config{RootCAs: mesh.Pool(), MinVersion: tls.VersionTLS12}
		if cert != nil {
			tc.Certificates = []tls.Certificate{cert.TLS}
		}
		conn, err := grpc.NewClient(admin, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	plain := dial(nil)
	jwt := func(ns, sa string) string {
		return issuer.Sign(t, authtest.Token{Namespace: ns, ServiceAccount: sa, TTL: 10 * time.Minute})
	}
	callers := []scopeCaller{
		{name: "static token", conn: plain, token: token},
		{name: "admin JWT", conn: plain, token: jwt("istio-system", "istioctl")},
		{name: "admin certificate", conn: dial(mesh.Workload(t, "cluster.local", "istio-system", "istioctl"))},
		{name: "ns-1 JWT", conn: plain, token: jwt("ns-1", "wl-0"), sees: "ns-1"},
		{name: "ns-0 JWT", conn: plain, token: jwt("ns-0", "viewer"), sees: "ns-0"},
		{name: "ns-2 certificate", conn: dial(mesh.Workload(t, "cluster.local", "ns-2", "ops")), sees: "ns-2"},
		{name: "nothing", conn: plain, code: codes.Unauthenticated},
		{name: "JWT of another issuer", conn: plain, token: issuer.Sign(t, authtest.Token{Namespace: "istio-system", ServiceAccount: "istioctl", Issuer: "https://evil.example"}),
			code: codes.Unauthenticated},
	}
	rctx, rcancel := context.WithTimeout(ctx, 60*time.Second)
	defer rcancel()
	root := callers[0]
	waitLedger(t, "9 Envoys current", func() (bool, string) {
		c, err := root.client().GetConvergence(root.ctx(rctx), &adminpb.ConvergenceRequest{})
		if err != nil {
			return false, err.Error()
		}
		return c.GetTier().GetEnvoys() == 9 && c.GetTier().GetCurrent() == 9 && len(c.GetMissing()) == 0, fmt.Sprint(c.GetTier())
	})
	if err := fleet.Envoys()[0].Stop(ctx); err != nil {
		t.Fatal(err)
	}
	waitLedger(t, "the Envoy that left behind", func() (bool, string) {
		c, err := root.client().GetConvergence(root.ctx(rctx), &adminpb.ConvergenceRequest{})
		if err != nil {
			return false, err.Error()
		}
		return c.GetTier().GetEnvoys() == 9 && c.GetTier().GetCurrent() == 8 && len(c.GetMissing()) == 0, fmt.Sprint(c.GetTier())
	})
	shards, err := root.client().ListShards(root.ctx(rctx), &adminpb.ListShardsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	keyOf := map[string]string{} // by namespace
	for _, s := range shards.GetShards() {
		keyOf[aggkey.Namespace(s.GetKey())] = s.GetKey()
	}
	if len(keyOf) != 3 || len(shards.GetShards()) != 3 {
		t.Fatalf("shards %v: want one key in each of the three namespaces", shards)
	}
	// A resource every Envoy holds (every service is public), and its
	// version as an Envoy shows it.
	dump, err := root.client().GetConfigDump(root.ctx(rctx), &adminpb.ConfigDumpRequest{Node: byNS["ns-1"][0]})
	if err != nil {
		t.Fatal(err)
	}
	clusterName, clusterVersion := firstCluster(t, dump)

	// want* are what caller c should be shown.
	wantNodes := func(c scopeCaller) []string {
		if c.sees != "" {
			return slices.Sorted(slices.Values(byNS[c.sees]))
		}
		return slices.Sorted(slices.Values(slices.Concat(byNS["ns-0"], byNS["ns-1"], byNS["ns-2"])))
	}
	wantKeys := func(c scopeCaller) []string {
		if c.sees != "" {
			return []string{keyOf[c.sees]}
		}
		return slices.Sorted(maps.Values(keyOf))
	}
	wantStragglers := func(c scopeCaller) []string {
		if c.sees == "" || c.sees == "ns-0" {
			return []string{gone}
		}
		return nil
	}
	current := func(c scopeCaller) int64 { return int64(len(wantNodes(c)) - len(wantStragglers(c))) }

	rpcs := map[string]func(t *testing.T, c scopeCaller) error{
		"GetRing": func(t *testing.T, c scopeCaller) error {
			ring, err := c.client().GetRing(c.ctx(rctx), &adminpb.GetRingRequest{})
			if err == nil && len(ring.GetMembers()) != 2 {
				t.Errorf("GetRing lists %d members, want 2 (membership is no namespace's)", len(ring.GetMembers()))
			}
			return err
		},
		"ListShards": func(t *testing.T, c scopeCaller) error {
			list, err := c.client().ListShards(c.ctx(rctx), &adminpb.ListShardsRequest{})
			var keys []string
			for _, s := range list.GetShards() {
				keys = append(keys, s.GetKey())
			}
			if err == nil && !slices.Equal(slices.Sorted(slices.Values(keys)), wantKeys(c)) {
				t.Errorf("ListShards = %q, want %q", keys, wantKeys(c))
			}
			return err
		},
		"GetShard": func(t *testing.T, c scopeCaller) error {
			for ns, key := range keyOf {
				d, err := c.client().GetShard(c.ctx(rctx), &adminpb.GetShardRequest{Key: key})
				switch {
				case c.code != codes.OK:
					return err
				case c.sees == "" || c.sees == ns:
					if err != nil || d.GetShard().GetKey() != key || d.GetShard().GetEnvoys() != 3 {
						t.Errorf("GetShard(%q) = %v, %v; want the key and its 3 Envoys", key, d.GetShard(), err)
					}
				case status.Code(err) != codes.PermissionDenied:
					t.Errorf("GetShard(%q) of namespace %s: %v, want PermissionDenied", key, ns, err)
				}
			}
			return nil
		},
		"GetConfigDump": func(t *testing.T, c scopeCaller) error {
			for ns, nodes := range byNS {
				node := nodes[1]
				for _, req := range []*adminpb.ConfigDumpRequest{{Node: node}, {Key: keyOf[ns]}} {
					d, err := c.client().GetConfigDump(c.ctx(rctx), req)
					switch {
					case c.code != codes.OK:
						return err
					case c.sees == "" || c.sees == ns:
						if err != nil || d.GetKey() != keyOf[ns] || d.GetConfigDump() == nil {
							t.Errorf("GetConfigDump(%v) = key %q, %v; want a dump of key %q", req, d.GetKey(), err, keyOf[ns])
						}
					case status.Code(err) != codes.PermissionDenied:
						t.Errorf("GetConfigDump(%v) of namespace %s: %v, want PermissionDenied", req, ns, err)
					}
				}
			}
			// One of the caller's namespace that does not exist: not found.
			if c.sees != "" {
				_, err := c.client().GetConfigDump(c.ctx(rctx), &adminpb.ConfigDumpRequest{Node: sc.Node(int(c.sees[len("ns-")]-'0'), 9, 9).GetId()})
				if status.Code(err) != codes.NotFound {
					t.Errorf("GetConfigDump of an Envoy of %s not on the tier: %v, want NotFound", c.sees, err)
				}
			}
			return nil
		},
		"GetConvergence": func(t *testing.T, c scopeCaller) error {
			conv, err := c.client().GetConvergence(c.ctx(rctx), &adminpb.ConvergenceRequest{})
			if err != nil {
				return err
			}
			if got := conv.GetTier(); got.GetEnvoys() != int64(len(wantNodes(c))) || got.GetCurrent() != current(c) {
				t.Errorf("GetConvergence tier = %v, want %d Envoys, %d current", got, len(wantNodes(c)), current(c))
			}
			if got := slices.Sorted(maps.Keys(conv.GetByKey())); !slices.Equal(got, wantKeys(c)) {
				t.Errorf("GetConvergence by key = %q, want %q", got, wantKeys(c))
			}
			var byRelay int64
			for _, r := range conv.GetByRelay() {
				byRelay += r.GetEnvoys()
			}
			if byRelay != int64(len(wantNodes(c))) {
				t.Errorf("GetConvergence by relay counts %d Envoys, want %d", byRelay, len(wantNodes(c)))
			}
			return nil
		},
		"ListStragglers": func(t *testing.T, c scopeCaller) error {
			list, err := c.client().ListStragglers(c.ctx(rctx), &adminpb.StragglersRequest{})
			var got []string
			for _, s := range list.GetStragglers() {
				got = append(got, s.GetNode())
			}
			if err == nil && !slices.Equal(got, wantStragglers(c)) {
				t.Errorf("ListStragglers = %q, want %q", got, wantStragglers(c))
			}
			return err
		},
		"CheckDelivery": func(t *testing.T, c scopeCaller) error {
			d, err := c.client().CheckDelivery(c.ctx(rctx), &adminpb.DeliveryRequest{Type: "type.googleapis.com/envoy.config.cluster.v3.Cluster", Name: clusterName, Hash: clusterVersion})
			if err != nil {
				return err
			}
			// Every Envoy holds it (the one that left ACKed it first).
			if n := int64(len(wantNodes(c))); d.GetEnvoys() != n || d.GetDelivered() != n || !d.GetDone() || len(d.GetMissing()) > 0 {
				t.Errorf("CheckDelivery = %v; want %d Envoys, all delivered", d, n)
			}
			return nil
		},
		"Wait": func(t *testing.T, c scopeCaller) error {
			st, err := c.client().Wait(c.ctx(rctx), &adminpb.WaitRequest{Share: 1, Timeout: durationpb.New(time.Second)})
			if err != nil {
				return err
			}
			var last *adminpb.Convergence
			for {
				msg, err := st.Recv()
				if err != nil && c.code != codes.OK {
					return err
				}
				if err != nil {
					reached := len(wantStragglers(c)) == 0
					switch {
					case reached && err != io.EOF:
						t.Errorf("Wait for %s's Envoys, all current: %v, want reached", c.name, err)
					case !reached && status.Code(err) != codes.DeadlineExceeded:
						t.Errorf("Wait with an Envoy gone: %v, want DeadlineExceeded", err)
						return nil
					case reached && !last.GetReached():
						t.Errorf("Wait ended with %v, want reached", last)
					}
					break
				}
				last = msg
			}
			if last.GetTier().GetEnvoys() != int64(len(wantNodes(c))) || !slices.Equal(slices.Sorted(maps.Keys(last.GetByKey())), wantKeys(c)) {
				t.Errorf("Wait's last word = %v, want %d Envoys of keys %q", last, len(wantNodes(c)), wantKeys(c))
			}
			var stragglers []string
			for _, s := range last.GetStragglers() {
				stragglers = append(stragglers, s.GetNode())
			}
			if !slices.Equal(stragglers, wantStragglers(c)) {
				t.Errorf("Wait's stragglers = %q, want %q", stragglers, wantStragglers(c))
			}
			return nil
		},
		"LocateEnvoy": func(t *testing.T, c scopeCaller) error {
			for ns, nodes := range byNS {
				info, err := c.client().LocateEnvoy(c.ctx(rctx), &adminpb.LocateEnvoyRequest{Node: nodes[1]})
				switch {
				case c.code != codes.OK:
					return err
				case c.sees == "" || c.sees == ns:
					if err != nil || info.GetNode() != nodes[1] || info.GetKey() != keyOf[ns] {
						t.Errorf("LocateEnvoy(%q) = %v, %v; want it, of key %q", nodes[1], info, err, keyOf[ns])
					}
				case status.Code(err) != codes.PermissionDenied:
					t.Errorf("LocateEnvoy(%q) of namespace %s: %v, want PermissionDenied", nodes[1], ns, err)
				}
			}
			return nil
		},
		"ListEnvoys": func(t *testing.T, c scopeCaller) error {
			for _, view := range []adminpb.EnvoyView{adminpb.EnvoyView_ENVOY_VIEW_BASIC, adminpb.EnvoyView_ENVOY_VIEW_FULL} {
				list, err := c.client().ListEnvoys(c.ctx(rctx), &adminpb.ListEnvoysRequest{View: view})
				if err != nil {
					return err
				}
				var got []string
				for _, e := range list.GetEnvoys() {
					got = append(got, e.GetNode())
				}
				if !slices.Equal(slices.Sorted(slices.Values(got)), wantNodes(c)) {
					t.Errorf("ListEnvoys(%s) = %q, want %q", view, got, wantNodes(c))
				}
			}
			return nil
		},
		"Drain": func(t *testing.T, c scopeCaller) error {
			// A relay this one is not: an admin gets as far as the name.
			_, err := c.client().Drain(c.ctx(rctx), &adminpb.DrainRequest{Relay: "relay-none"})
			switch {
			case c.code != codes.OK:
				return err
			case c.sees == "" && status.Code(err) != codes.FailedPrecondition:
				t.Errorf("Drain of another relay by an admin: %v, want FailedPrecondition", err)
			case c.sees != "" && status.Code(err) != codes.PermissionDenied:
				t.Errorf("Drain by %s with mutations allowed: %v, want PermissionDenied", c.name, err)
			}
			if !relays[0].Node.Relay().Ready() {
				t.Fatal("a refused Drain drained the relay")
			}
			return nil
		},
	}
	for _, m := range adminpb.Admin_ServiceDesc.Methods {
		if rpcs[m.MethodName] == nil {
			t.Errorf("RPC %s is not in the test: how does a caller of a namespace see it?", m.MethodName)
		}
	}
	for _, s := range adminpb.Admin_ServiceDesc.Streams {
		if rpcs[s.StreamName] == nil {
			t.Errorf("RPC %s is not in the test: how does a caller of a namespace see it?", s.StreamName)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(rpcs)) {
		t.Run(name, func(t *testing.T) {
			for _, c := range callers {
				err := rpcs[name](t, c)
				if status.Code(err) != c.code {
					t.Errorf("%s by %s: %v, want %s", name, c.name, err, c.code)
				}
				if c.token != "" && err != nil && strings.Contains(err.Error(), c.token) {
					t.Errorf("%s by %s: the refusal %q repeats the token", name, c.name, err)
				}
			}
		})
	}
}

// firstCluster returns the name and version (as an Envoy shows it) of the
// first dynamic cluster of a config dump.
func firstCluster(t *testing.T, d *inspectpb.ConfigDump) (name, version string) {
	t.Helper()
	var dump envoyadmin.ConfigDump
	if err := d.GetConfigDump().UnmarshalTo(&dump); err != nil {
		t.Fatal(err)
	}
	for _, a := range dump.GetConfigs() {
		var cd envoyadmin.ClustersConfigDump
		if !a.MessageIs(&cd) {
			continue
		}
		if err := a.UnmarshalTo(&cd); err != nil {
			t.Fatal(err)
		}
		for _, c := range cd.GetDynamicActiveClusters() {
			var cl clusterv3.Cluster
			if err := c.GetCluster().UnmarshalTo(&cl); err != nil {
				t.Fatal(err)
			}
			return cl.GetName(), c.GetVersionInfo()
		}
	}
	t.Fatal("the config dump holds no cluster")
	return "", ""
}
