package relay

import (
	"context"
	"crypto/subtle"
	"net/http"
	"slices"
	"strings"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/auth"
)

// The admin listener serves HTTP/1 (health, readiness, /metrics, pprof) and,
// over HTTP/2 on the same port, gRPC: grpc.health.v1 (the relay's
// readiness), server reflection, and whatever Config.AdminServices
// registers (the admin API of the tier). With Config.AdminTLS it serves
// TLS (mTLS if the config asks for client certificates).
//
// Who may do what (every gRPC call but health checks, and pprof):
//
//   - with neither Config.AdminToken nor Config.AdminAuthenticator, a
//     caller whose client certificate the TLS handshake verified (AdminTLS
//     with client CAs) is an admin; any other caller is an admin only if
//     the relay's xDS port does not authenticate (Config.Authenticator
//     nil: a plaintext or development set-up, guarded by the network),
//     and Unauthenticated if it does: a relay that keeps each namespace's
//     config from the others on its xDS port does not hand all of it out
//     on an unguarded admin port;
//   - a call carrying AdminToken as "authorization: Bearer" is an admin;
//   - else, with an AdminAuthenticator, the call proves an identity (a
//     service-account JWT, or a SPIFFE client certificate): one in
//     Config.AdminIdentities is an admin, any other is scoped to its
//     namespace (AdminCaller), and a call that proves none is
//     Unauthenticated;
//   - else it is Unauthenticated.
//
// The services read the verdict with AdminCallerFrom: a scoped caller sees
// only its namespace's Envoys, keys and config, and changes nothing. pprof
// (which can show anything in memory) wants an admin.

// AdminCaller is who an admin API call comes from, as the admin listener
// proved it. The zero AdminCaller sees nothing: it is what a context the
// admin listener did not vouch for holds.
type AdminCaller struct {
	// Admin sees the whole tier and may change it (where the relay
	// allows mutating calls at all).
	Admin bool
	// Namespace is, for a caller that is not an admin, the only
	// namespace whose Envoys, keys and config it sees ("" for an admin).
	Namespace string
	// Identity is the SPIFFE ID the caller proved; "" for the admin token
	// or an open admin API.
	Identity string
}

type adminCallerKey struct{}

// AdminCallerFrom returns the caller of the admin call ctx belongs to, or
// the zero AdminCaller (which sees nothing) if the admin listener did not
// decide it.
func AdminCallerFrom(ctx context.Context) AdminCaller {
	c, _ := ctx.Value(adminCallerKey{}).(AdminCaller)
	return c
}

func withAdminCaller(ctx context.Context, c AdminCaller) context.Context {
	return context.WithValue(ctx, adminCallerKey{}, c)
}

// String names the caller for logs and errors.
func (c AdminCaller) String() string {
	switch {
	case c.Admin && c.Identity != "":
		return "admin " + c.Identity
	case c.Admin:
		return "admin"
	case c.Identity != "":
		return c.Identity + " (namespace " + c.Namespace + ")"
	}
	return "nobody"
}

// SeesKey reports whether the caller may see key, its Envoys and its
// config: an admin sees every key, another caller the keys of its
// namespace (aggkey.Namespace).
func (c AdminCaller) SeesKey(key string) bool {
	return c.Admin || c.Namespace != "" && aggkey.Namespace(key) == c.Namespace
}

// MayAskNode reports whether the caller may ask for the node named id:
// an admin may ask for any; another caller for a node whose id names its
// namespace or none. It says nothing of whether the node exists, so a
// refusal reveals nothing; the answer's key (SeesKey) has the last word.
func (c AdminCaller) MayAskNode(id string) bool {
	if c.Admin {
		return true
	}
	ns := auth.ConfigNamespace(&core.Node{Id: id})
	return c.Namespace != "" && (ns == "" || ns == c.Namespace)
}

// newAdminGRPC builds the admin listener's gRPC server: every call but
// health checks is authenticated (adminCaller) and carries its caller in
// its context.
func (r *Relay) newAdminGRPC() *grpc.Server {
	s := grpc.NewServer(grpc.MaxSendMsgSize(r.cfg.MaxMsgSize),
		grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			if isHealth(info.FullMethod) {
				return handler(ctx, req)
			}
			c, err := r.adminCaller(ctx, info.FullMethod)
			if err != nil {
				return nil, err
			}
			return handler(withAdminCaller(ctx, c), req)
		}),
		grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
			if isHealth(info.FullMethod) {
				return handler(srv, ss)
			}
			c, err := r.adminCaller(ss.Context(), info.FullMethod)
			if err != nil {
				return err
			}
			return handler(srv, callerStream{ss, withAdminCaller(ss.Context(), c)})
		}))
	healthpb.RegisterHealthServer(s, adminHealth{r})
	reflection.Register(s)
	if r.cfg.AdminServices != nil {
		r.cfg.AdminServices(s)
	}
	return s
}

// Health checks need no credentials: kubelet's gRPC probes carry none,
// and readiness tells nothing secret.
func isHealth(method string) bool { return strings.HasPrefix(method, "/grpc.health.v1.Health/") }

// callerStream is a server stream whose context carries its AdminCaller.
type callerStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s callerStream) Context() context.Context { return s.ctx }

// adminCaller decides who an admin call (of method, for logs) is from, by
// the rules above. Refusals name what was wrong with a credential, never
// the credential; they are logged at most a few times a second.
func (r *Relay) adminCaller(ctx context.Context, method string) (AdminCaller, error) {
	if r.cfg.AdminToken == "" && r.cfg.AdminAuthenticator == nil {
		if r.cfg.Authenticator != nil && !handshakeVerified(ctx) {
			return AdminCaller{}, status.Error(codes.Unauthenticated, "the admin API is closed: this relay authenticates its xDS port, and its admin listener has no --admin-identities, --admin-token-file or --admin-client-ca to prove callers with")
		}
		return AdminCaller{Admin: true}, nil
	}
	if r.cfg.AdminToken != "" {
		md, _ := metadata.FromIncomingContext(ctx)
		for _, v := range md.Get("authorization") {
			if r.tokenMatches(v) {
				return AdminCaller{Admin: true}, nil
			}
		}
	}
	if r.cfg.AdminAuthenticator == nil {
		return AdminCaller{}, status.Error(codes.Unauthenticated, "the admin API wants a bearer token (authorization: Bearer <token>)")
	}
	id, err := r.cfg.AdminAuthenticator.Authenticate(ctx)
	if err != nil {
		return AdminCaller{}, r.refuseAuth(ctx, "admin call "+method,
			"the admin API wants the admin token, a service-account token (authorization: Bearer) or a SPIFFE client certificate", err)
	}
	return r.identityCaller(id), nil
}

// handshakeVerified reports whether ctx's caller presented a client
// certificate its TLS handshake verified (AdminTLS with client CAs).
func handshakeVerified(ctx context.Context) bool {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return false
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	return ok && len(ti.State.VerifiedChains) > 0
}

// identityCaller is what a proven identity may do, on the admin API and
// in debug requests over xDS: everything if Config.AdminIdentities names
// it, else see its own namespace.
func (r *Relay) identityCaller(id auth.Identity) AdminCaller {
	spiffe := id.SPIFFEID()
	if slices.Contains(r.cfg.AdminIdentities, spiffe) {
		return AdminCaller{Admin: true, Identity: spiffe}
	}
	return AdminCaller{Namespace: id.Namespace, Identity: spiffe}
}

// tokenMatches reports whether an authorization header carries the admin
// token, in time that does not depend on where they differ.
func (r *Relay) tokenMatches(header string) bool {
	token, ok := strings.CutPrefix(header, "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(token), []byte(r.cfg.AdminToken)) == 1
}

// adminAuthHTTP lets through only admins (adminCaller, from the request's
// Authorization header and client certificate): 401 for a request that
// proves nothing, 403 for a caller scoped to a namespace, 503 while the
// verifier cannot decide.
func (r *Relay) adminAuthHTTP(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		ctx := metadata.NewIncomingContext(req.Context(), metadata.MD{"authorization": req.Header.Values("Authorization")})
		p := &peer.Peer{}
		if req.TLS != nil {
			p.AuthInfo = credentials.TLSInfo{State: *req.TLS}
		}
		c, err := r.adminCaller(peer.NewContext(ctx, p), req.URL.Path)
		switch {
		case status.Code(err) == codes.Unavailable:
			// The verifier could not decide (the Kubernetes API is down):
			// not the caller's fault, as on the gRPC admin calls.
			http.Error(w, "the admin caller could not be verified now; try again", http.StatusServiceUnavailable)
			return
		case err != nil:
			w.Header().Set("WWW-Authenticate", "Bearer")
			http.Error(w, "this endpoint wants an admin: the admin bearer token, or an admin identity's token or certificate", http.StatusUnauthorized)
			return
		case !c.Admin:
			http.Error(w, "this endpoint is for admins; "+c.String()+" is not one", http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, req)
	})
}

// adminHandler sends gRPC requests to g and everything else to mux.
func adminHandler(g *grpc.Server, mux http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.ProtoMajor == 2 && strings.HasPrefix(req.Header.Get("Content-Type"), "application/grpc") {
			g.ServeHTTP(w, req)
			return
		}
		mux.ServeHTTP(w, req)
	})
}

// adminProtocols are HTTP/1 and HTTP/2, over TLS (Config.AdminTLS) or
// cleartext (h2c: gRPC without TLS).
func adminProtocols() *http.Protocols {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	p.SetHTTP2(true)
	p.SetUnencryptedHTTP2(true)
	return p
}

// adminHealth answers grpc.health.v1 with the relay's readiness: SERVING
// once it has config to serve and until it drains.
type adminHealth struct{ r *Relay }

func (h adminHealth) status() healthpb.HealthCheckResponse_ServingStatus {
	if h.r.Ready() {
		return healthpb.HealthCheckResponse_SERVING
	}
	return healthpb.HealthCheckResponse_NOT_SERVING
}

func (h adminHealth) Check(_ context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	if req.GetService() != "" {
		return nil, status.Errorf(codes.NotFound, "unknown service %q: ask for \"\" (the relay)", req.GetService())
	}
	return &healthpb.HealthCheckResponse{Status: h.status()}, nil
}

func (h adminHealth) List(context.Context, *healthpb.HealthListRequest) (*healthpb.HealthListResponse, error) {
	return &healthpb.HealthListResponse{Statuses: map[string]*healthpb.HealthCheckResponse{"": {Status: h.status()}}}, nil
}

// Watch sends the status, then every change of it (checked each second),
// until the caller leaves or the relay stops.
func (h adminHealth) Watch(req *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	if req.GetService() != "" {
		return status.Errorf(codes.NotFound, "unknown service %q: ask for \"\" (the relay)", req.GetService())
	}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	last := healthpb.HealthCheckResponse_UNKNOWN
	for {
		if st := h.status(); st != last {
			if err := stream.Send(&healthpb.HealthCheckResponse{Status: st}); err != nil {
				return err
			}
			last = st
		}
		select {
		case <-stream.Context().Done():
			return stream.Context().Err()
		case <-h.r.stopping:
			return status.Error(codes.Unavailable, "relay stopping")
		case <-t.C:
		}
	}
}
