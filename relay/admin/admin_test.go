package admin_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/admin"
	"github.com/meshrelay/meshrelay/relay/auth"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const adminID = "spiffe://cluster.local/ns/istio-system/sa/istioctl"

func TestCallerMayAsk(t *testing.T) {
	const ns1, ns2 = "sidecar~10.0.0.1~app-0.ns1~ns1.svc.cluster.local", "sidecar~10.0.0.2~app-0.ns2~ns2.svc.cluster.local"
	scoped := admin.Caller{Namespace: "ns1", Identity: "spiffe://cluster.local/ns/ns1/sa/app"}
	for _, tc := range []struct {
		c       admin.Caller
		key, id string
		sees    bool
		mayAsk  bool
	}{
		{admin.Caller{Admin: true}, "sidecar/ns2/app#1", ns2, true, true},
		{admin.Caller{Admin: true}, "node/weird#1", "weird", true, true},
		{scoped, "sidecar/ns1/app#1", ns1, true, true},
		{scoped, "sidecar/ns2/app#1", ns2, false, false},
		// An id that names no namespace may be asked for; its key decides.
		{scoped, "node/weird#1", "weird", false, true},
		{admin.Caller{}, "sidecar/ns1/app#1", ns1, false, false},
	} {
		if got := tc.c.SeesKey(tc.key); got != tc.sees {
			t.Errorf("%v.SeesKey(%q) = %v, want %v", tc.c, tc.key, got, tc.sees)
		}
		if got := tc.c.MayAskNode(tc.id); got != tc.mayAsk {
			t.Errorf("%v.MayAskNode(%q) = %v, want %v", tc.c, tc.id, got, tc.mayAsk)
		}
	}
}

// bearer proves the identity its token names: a stand-in for a JWT
// verifier (relay/auth's are tested against a real Kubernetes API).
type bearer map[string]auth.Identity

func (b bearer) Authenticate(ctx context.Context) (auth.Identity, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	for _, v := range md.Get("authorization") {
		if id, ok := b[v]; ok {
			return id, nil
		}
	}
	return auth.Identity{}, errors.New("no token this verifier knows")
}

// call is the context of an admin call with an authorization header
// (token, if any) and, if verified, a client certificate its TLS
// handshake verified.
func call(token string, verified bool) context.Context {
	ctx := context.Background()
	if token != "" {
		ctx = metadata.NewIncomingContext(ctx, metadata.Pairs("authorization", "Bearer "+token))
	}
	p := &peer.Peer{}
	if verified {
		p.AuthInfo = credentials.TLSInfo{State: tls.ConnectionState{VerifiedChains: [][]*x509.Certificate{{{}}}}}
	}
	return peer.NewContext(ctx, p)
}

// TestGuard: who each credential makes a call from, under each guard, as
// the package comment's rules say; refusals are Unauthenticated.
func TestGuard(t *testing.T) {
	ids := bearer{
		"Bearer jwt-istioctl": {Namespace: "istio-system", ServiceAccount: "istioctl", TrustDomain: "cluster.local"},
		"Bearer jwt-ns1":      {Namespace: "ns1", ServiceAccount: "app", TrustDomain: "cluster.local"},
	}
	open := &admin.Guard{}
	closed := &admin.Guard{XDSAuthenticated: true}
	token := &admin.Guard{Token: "tok", XDSAuthenticated: true}
	full := &admin.Guard{Token: "tok", Authenticator: ids, Identities: []string{adminID}, XDSAuthenticated: true}
	for _, tc := range []struct {
		name     string
		g        *admin.Guard
		token    string
		verified bool
		want     admin.Caller
		code     codes.Code
	}{
		{"open, nothing", open, "", false, admin.Caller{Admin: true}, codes.OK},
		{"open, any token", open, "whatever", false, admin.Caller{Admin: true}, codes.OK},
		{"closed, nothing", closed, "", false, admin.Caller{}, codes.Unauthenticated},
		{"closed, any token", closed, "whatever", false, admin.Caller{}, codes.Unauthenticated},
		{"closed, verified certificate", closed, "", true, admin.Caller{Admin: true}, codes.OK},
		{"token, the token", token, "tok", false, admin.Caller{Admin: true}, codes.OK},
		{"token, another", token, "tok2", false, admin.Caller{}, codes.Unauthenticated},
		{"token, a prefix of it", token, "to", false, admin.Caller{}, codes.Unauthenticated},
		{"token, nothing", token, "", false, admin.Caller{}, codes.Unauthenticated},
		{"full, the token", full, "tok", false, admin.Caller{Admin: true}, codes.OK},
		{"full, admin identity", full, "jwt-istioctl", false, admin.Caller{Admin: true, Identity: adminID}, codes.OK},
		{"full, another identity", full, "jwt-ns1", false, admin.Caller{Namespace: "ns1", Identity: "spiffe://cluster.local/ns/ns1/sa/app"}, codes.OK},
		{"full, unknown token", full, "jwt-evil", false, admin.Caller{}, codes.Unauthenticated},
		{"full, nothing", full, "", false, admin.Caller{}, codes.Unauthenticated},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.g.Caller(call(tc.token, tc.verified), "/test")
			if got != tc.want || status.Code(err) != tc.code {
				t.Errorf("Caller = %v, %v; want %v, %v", got, err, tc.want, tc.code)
			}
		})
	}
}

// TestGuardRefuse: a failed authentication is answered by Guard.Refuse
// (the relay's: logged, Unavailable when the verifier could not decide).
func TestGuardRefuse(t *testing.T) {
	g := &admin.Guard{Authenticator: bearer{}, Refuse: func(_ context.Context, what, _ string, _ error) error {
		return status.Error(codes.Unavailable, what+": verifier down")
	}}
	if _, err := g.Caller(call("x", false), "/m"); status.Code(err) != codes.Unavailable || status.Convert(err).Message() != "admin call /m: verifier down" {
		t.Errorf("Caller = %v, want Refuse's Unavailable", err)
	}
}

// TestAdminsOnly: the HTTP endpoints (pprof) let admins through alone.
func TestAdminsOnly(t *testing.T) {
	ids := bearer{"Bearer jwt-ns1": {Namespace: "ns1", ServiceAccount: "app", TrustDomain: "cluster.local"}}
	down := &admin.Guard{Authenticator: bearer{}, Refuse: func(context.Context, string, string, error) error {
		return status.Error(codes.Unavailable, "down")
	}}
	for _, tc := range []struct {
		name  string
		g     *admin.Guard
		token string
		want  int
	}{
		{"the token", &admin.Guard{Token: "tok"}, "tok", http.StatusOK},
		{"nothing", &admin.Guard{Token: "tok"}, "", http.StatusUnauthorized},
		{"scoped caller", &admin.Guard{Authenticator: ids}, "jwt-ns1", http.StatusForbidden},
		{"verifier down", down, "x", http.StatusServiceUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := tc.g.AdminsOnly(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }))
			req := httptest.NewRequest(http.MethodGet, "/debug/pprof/", nil)
			if tc.token != "" {
				req.Header.Set("Authorization", "Bearer "+tc.token)
			}
			w := httptest.NewRecorder()
			h.ServeHTTP(w, req)
			if w.Code != tc.want {
				t.Errorf("status = %d, want %d", w.Code, tc.want)
			}
		})
	}
}

// TestHealth: the relay's readiness, and only the relay's ("").
func TestHealth(t *testing.T) {
	ready := false
	h := admin.Health{Ready: func() bool { return ready }, Stopping: make(chan struct{})}
	for _, r := range []bool{false, true} {
		ready = r
		want := map[bool]healthpb.HealthCheckResponse_ServingStatus{false: healthpb.HealthCheckResponse_NOT_SERVING, true: healthpb.HealthCheckResponse_SERVING}[r]
		if got, err := h.Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil || got.GetStatus() != want {
			t.Errorf("Check, ready %v = %v, %v; want %v", r, got, err, want)
		}
	}
	if _, err := h.Check(context.Background(), &healthpb.HealthCheckRequest{Service: "other"}); status.Code(err) != codes.NotFound {
		t.Errorf("Check(other) = %v, want NotFound", err)
	}
}

// watchStream is the server side of a Watch: what it sent.
type watchStream struct {
	healthpb.Health_WatchServer
	ctx  context.Context
	sent chan healthpb.HealthCheckResponse_ServingStatus
}

func (w *watchStream) Context() context.Context { return w.ctx }

func (w *watchStream) Send(r *healthpb.HealthCheckResponse) error {
	w.sent <- r.GetStatus()
	return nil
}

// TestHealthWatch: a watcher hears the status at once, each change within
// the second it is checked in, and nothing while it stays; the watch ends
// when the relay stops. In a synctest bubble: time is the bubble's.
func TestHealthWatch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var ready atomic.Bool
		stopping := make(chan struct{})
		h := admin.Health{Ready: ready.Load, Stopping: stopping}
		w := &watchStream{ctx: t.Context(), sent: make(chan healthpb.HealthCheckResponse_ServingStatus, 8)}
		done := make(chan error, 1)
		go func() { done <- h.Watch(&healthpb.HealthCheckRequest{}, w) }()
		synctest.Wait()
		if got := <-w.sent; got != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Fatalf("first status = %v, want NOT_SERVING", got)
		}
		time.Sleep(10 * time.Second)
		synctest.Wait()
		if len(w.sent) != 0 {
			t.Fatalf("%d statuses sent while nothing changed, want none", len(w.sent))
		}
		ready.Store(true)
		start := time.Now()
		got := <-w.sent
		if got != healthpb.HealthCheckResponse_SERVING || time.Since(start) > time.Second {
			t.Fatalf("after the change: %v after %v, want SERVING within a second", got, time.Since(start))
		}
		close(stopping)
		if err := <-done; status.Code(err) != codes.Unavailable {
			t.Fatalf("Watch ended with %v once the relay stops, want Unavailable", err)
		}
	})
}
