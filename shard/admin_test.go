package shard_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/loadtest"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
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
	tier, err := loadtest.StartConvergedTier(ctx, loadtest.TierConfig{Relays: 3, Upstream: up.Addr(), Logger: testLogger(),
		DrainPeriod: 500 * time.Millisecond,
		Relay: func(c *relay.Config) {
			c.AdminListen, c.AdminTLS, c.AdminToken = "127.0.0.1:0", certs.Server, token
		},
		Node: func(c *shard.NodeConfig) { c.AllowMutations = c.Relay.ID != "relay-2" },
	}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tier.Stop(context.Background()) })
	fleet, err := loadtest.StartFleet(ctx, loadtest.FleetConfig{Scenario: sc, Envoys: 30, Keys: 3, Protocol: envoy.Delta, Target: tier.Addr()})
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
