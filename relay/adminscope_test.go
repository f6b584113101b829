package relay

import (
	"context"
	"crypto/tls"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshrelay/meshrelay/relay/admin"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

// adminID is the admins' SPIFFE ID in these tests.
const adminID = "spiffe://cluster.local/ns/istio-system/sa/istioctl"

// whoami is a service of the test's own on the admin listener: each call
// (unary Who, server-streaming Watch) is answered with the admin.Caller its
// context carries.
var whoami = grpc.ServiceDesc{
	ServiceName: "meshrelay.test.Whoami",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{MethodName: "Who", Handler: func(_ any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
		in := new(emptypb.Empty)
		if err := dec(in); err != nil {
			return nil, err
		}
		h := func(ctx context.Context, _ any) (any, error) { return callerStruct(admin.CallerFrom(ctx)), nil }
		if icpt == nil {
			return h(ctx, in)
		}
		return icpt(ctx, in, &grpc.UnaryServerInfo{FullMethod: "/meshrelay.test.Whoami/Who"}, h)
	}}},
	Streams: []grpc.StreamDesc{{StreamName: "Watch", ServerStreams: true, Handler: func(_ any, ss grpc.ServerStream) error {
		if err := ss.RecvMsg(new(emptypb.Empty)); err != nil {
			return err
		}
		return ss.SendMsg(callerStruct(admin.CallerFrom(ss.Context())))
	}}},
}

func callerStruct(c admin.Caller) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		"admin": structpb.NewBoolValue(c.Admin), "namespace": structpb.NewStringValue(c.Namespace), "identity": structpb.NewStringValue(c.Identity)}}
}

func structCaller(s *structpb.Struct) admin.Caller {
	f := s.GetFields()
	return admin.Caller{Admin: f["admin"].GetBoolValue(), Namespace: f["namespace"].GetStringValue(), Identity: f["identity"].GetStringValue()}
}

// newAdminEnv is a secure relay (TLS xDS port, --xds-auth any) whose admin
// listener serves the same TLS, asks for client certificates (the
// authenticator verifies them), and has the admin token (unless "") and
// the authenticator of the TLS port, with adminID as the admins.
func newAdminEnv(t *testing.T, token string, mod func(*Config)) *secureEnv {
	t.Helper()
	return newSecureEnv(t, auth.ModeAny, func(c *Config) {
		c.Admin.Listen, c.Admin.TLS, c.Admin.Token = "127.0.0.1:0", c.XDS.TLS, token
		c.Admin.Authenticator, c.Admin.Identities = c.XDS.Authenticator, []string{adminID}
		c.Admin.Services = func(s *grpc.Server) { s.RegisterService(&whoami, struct{}{}) }
		if mod != nil {
			mod(c)
		}
	})
}

// adminTLS is the client side of the admin listener's TLS, presenting
// cert if set.
func (e *secureEnv) adminTLS(cert *authtest.Issued) *tls.Config {
	tc := &tls.Config{RootCAs: e.mesh.Pool(), ServerName: "meshrelay.istio-system.svc", MinVersion: tls.VersionTLS12}
	if cert != nil {
		tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert.TLS, nil }
	}
	return tc
}

func (e *secureEnv) dialAdmin(t *testing.T, cert *authtest.Issued) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(e.r.AdminAddr().String(), grpc.WithTransportCredentials(credentials.NewTLS(e.adminTLS(cert))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// whoIs asks Who and Watch with c and returns the caller each saw; both
// must agree.
func (e *secureEnv) whoIs(t *testing.T, c creds) (admin.Caller, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if c.token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.token)
	}
	conn := e.dialAdmin(t, c.cert)
	unary := new(structpb.Struct)
	uerr := conn.Invoke(ctx, "/meshrelay.test.Whoami/Who", &emptypb.Empty{}, unary)
	streamed := new(structpb.Struct)
	st, serr := conn.NewStream(ctx, &whoami.Streams[0], "/meshrelay.test.Whoami/Watch")
	if serr == nil {
		if serr = st.SendMsg(&emptypb.Empty{}); serr == nil {
			st.CloseSend()
			serr = st.RecvMsg(streamed)
		}
	}
	if status.Code(uerr) != status.Code(serr) || structCaller(unary) != structCaller(streamed) {
		t.Fatalf("Who = %v, %v but Watch = %v, %v: the stream interceptor decides otherwise", structCaller(unary), uerr, structCaller(streamed), serr)
	}
	return structCaller(unary), uerr
}

// pprof returns the status of GET /debug/pprof/ with c, over HTTP/2.
func (e *secureEnv) pprof(t *testing.T, c creds) int {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: e.adminTLS(c.cert), ForceAttemptHTTP2: true}, Timeout: 10 * time.Second}
	defer hc.CloseIdleConnections()
	req, _ := http.NewRequest(http.MethodGet, "https://"+e.r.AdminAddr().String()+"/debug/pprof/", nil)
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestAdminCallers: who each credential makes an admin call from, by the
// admin listener's rules, on a unary and a streaming call alike, and what
// pprof answers it. A refusal never repeats the token.
func TestAdminCallers(t *testing.T) {
	const static = "static-admin-token"
	e := newAdminEnv(t, static, nil)
	now := time.Now()
	jwt := func(ns, sa string) string { return e.issuer.Sign(t, authtest.Token{Namespace: ns, ServiceAccount: sa}) }
	foreign := authtest.NewCA(t, "another root")
	for _, tc := range []struct {
		name  string
		creds creds
		want  admin.Caller
		code  codes.Code
		pprof int
	}{
		{"static token", creds{token: static}, admin.Caller{Admin: true}, codes.OK, http.StatusOK},
		{"admin JWT", creds{token: jwt("istio-system", "istioctl")}, admin.Caller{Admin: true, Identity: adminID}, codes.OK, http.StatusOK},
		{"admin certificate", creds{cert: e.mesh.Workload(t, "cluster.local", "istio-system", "istioctl")}, admin.Caller{Admin: true, Identity: adminID}, codes.OK, http.StatusOK},
		{"JWT of ns1", creds{token: jwt("ns1", "app")}, admin.Caller{Namespace: "ns1", Identity: "spiffe://cluster.local/ns/ns1/sa/app"}, codes.OK, http.StatusForbidden},
		{"JWT of istio-system, not an admin", creds{token: jwt("istio-system", "other")}, admin.Caller{Namespace: "istio-system", Identity: "spiffe://cluster.local/ns/istio-system/sa/other"}, codes.OK, http.StatusForbidden},
		{"certificate of ns2", creds{cert: e.mesh.Workload(t, "cluster.local", "ns2", "db")}, admin.Caller{Namespace: "ns2", Identity: "spiffe://cluster.local/ns/ns2/sa/db"}, codes.OK, http.StatusForbidden},
		{"wrong static token", creds{token: static + "x"}, admin.Caller{}, codes.Unauthenticated, http.StatusUnauthorized},
		{"expired admin JWT", creds{token: e.issuer.Sign(t, authtest.Token{Namespace: "istio-system", ServiceAccount: "istioctl", IssuedAt: now.Add(-3 * time.Hour), TTL: time.Hour})}, admin.Caller{}, codes.Unauthenticated, http.StatusUnauthorized},
		{"admin JWT of another issuer", creds{token: e.issuer.Sign(t, authtest.Token{Namespace: "istio-system", ServiceAccount: "istioctl", Issuer: "https://evil.example"})}, admin.Caller{}, codes.Unauthenticated, http.StatusUnauthorized},
		{"admin certificate of another root", creds{cert: foreign.Workload(t, "cluster.local", "istio-system", "istioctl")}, admin.Caller{}, codes.Unauthenticated, http.StatusUnauthorized},
		{"nothing", creds{}, admin.Caller{}, codes.Unauthenticated, http.StatusUnauthorized},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := e.whoIs(t, tc.creds)
			if status.Code(err) != tc.code || got != tc.want {
				t.Fatalf("caller = %+v, %v; want %+v, %s", got, err, tc.want, tc.code)
			}
			if tc.creds.token != "" && err != nil && strings.Contains(err.Error(), tc.creds.token) {
				t.Fatalf("the refusal %q repeats the token", err)
			}
			if got := e.pprof(t, tc.creds); got != tc.pprof {
				t.Errorf("GET /debug/pprof/: %d, want %d", got, tc.pprof)
			}
		})
	}
	t.Run("health needs nothing", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		h, err := healthpb.NewHealthClient(e.dialAdmin(t, nil)).Check(ctx, &healthpb.HealthCheckRequest{})
		if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health without credentials = %v, %v; want SERVING", h, err)
		}
	})
}

// TestAdminCallersWithoutAuthenticator: without an admin authenticator
// the token alone makes an admin and a JWT is refused; with no token
// either, a relay whose xDS port authenticates answers only callers whose
// client certificate the admin handshake verified (its admin API would
// otherwise hand every namespace's config to anyone), and one whose xDS
// port does not (plaintext, development) answers everyone as an admin.
func TestAdminCallersWithoutAuthenticator(t *testing.T) {
	for _, tc := range []struct {
		name      string
		token     string
		xdsAuth   bool // the xDS port authenticates
		mtlsAdmin bool // the admin listener requires and verifies client certificates
		creds     creds
		want      admin.Caller
		code      codes.Code
		pprof     int
	}{
		{"open, plaintext relay, nothing", "", false, false, creds{}, admin.Caller{Admin: true}, codes.OK, http.StatusOK},
		{"open, plaintext relay, any bearer token", "", false, false, creds{token: "whatever"}, admin.Caller{Admin: true}, codes.OK, http.StatusOK},
		{"open, authenticating relay, nothing", "", true, false, creds{}, admin.Caller{}, codes.Unauthenticated, http.StatusUnauthorized},
		{"open, authenticating relay, any bearer token", "", true, false, creds{token: "whatever"}, admin.Caller{}, codes.Unauthenticated, http.StatusUnauthorized},
		{"mTLS admin, authenticating relay, verified certificate", "", true, true, creds{cert: nil}, admin.Caller{Admin: true}, codes.OK, http.StatusOK},
		{"token, the token", "tok", true, false, creds{token: "tok"}, admin.Caller{Admin: true}, codes.OK, http.StatusOK},
		{"token, nothing", "tok", true, false, creds{}, admin.Caller{}, codes.Unauthenticated, http.StatusUnauthorized},
		{"token, another bearer token", "tok", true, false, creds{token: "not-the-token"}, admin.Caller{}, codes.Unauthenticated, http.StatusUnauthorized},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newAdminEnv(t, tc.token, func(c *Config) {
				c.Admin.Authenticator = nil
				if !tc.xdsAuth {
					c.XDS.Authenticator = nil
				}
				if tc.mtlsAdmin {
					// As --admin-client-ca alone configures it: the
					// handshake requires and verifies client certificates.
					x := c.XDS.TLS
					c.Admin.TLS = &tls.Config{GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
						cc, err := x.GetConfigForClient(h)
						if err != nil {
							return nil, err
						}
						cc = cc.Clone()
						cc.ClientAuth = tls.RequireAndVerifyClientCert
						return cc, nil
					}}
				}
			})
			c := tc.creds
			if tc.mtlsAdmin {
				c.cert = e.mesh.Workload(t, "cluster.local", "ops", "oncall")
			}
			got, err := e.whoIs(t, c)
			if status.Code(err) != tc.code || got != tc.want {
				t.Fatalf("caller = %+v, %v; want %+v, %s", got, err, tc.want, tc.code)
			}
			if got := e.pprof(t, c); got != tc.pprof {
				t.Errorf("GET /debug/pprof/: %d, want %d", got, tc.pprof)
			}
		})
	}
}
