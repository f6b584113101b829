// Package admin is the relay's admin listener: who an admin call comes
// from (Caller, decided by a Guard), the handler that serves HTTP/1
// (health, readiness, /metrics, pprof) and, over HTTP/2 on the same port,
// gRPC, and its grpc.health.v1 service. The admin API of the tier is
// registered on it by the relay's caller.
//
// Who may do what (every gRPC call but health checks, and pprof):
//
//   - with neither Guard.Token nor Guard.Authenticator, a caller whose
//     client certificate the TLS handshake verified (a listener serving
//     mTLS) is an admin; any other caller is an admin only if the relay's
//     xDS port does not authenticate (Guard.XDSAuthenticated false: a
//     plaintext or development set-up, guarded by the network), and
//     Unauthenticated if it does: a relay that keeps each namespace's
//     config from the others on its xDS port does not hand all of it out
//     on an unguarded admin port;
//   - a call carrying Guard.Token as "authorization: Bearer" is an admin;
//   - else, with a Guard.Authenticator, the call proves an identity (a
//     service-account JWT, or a SPIFFE client certificate): one in
//     Guard.Identities is an admin, any other is scoped to its namespace
//     (Caller), and a call that proves none is Unauthenticated;
//   - else it is Unauthenticated.
//
// The services read the verdict with CallerFrom: a scoped caller sees only
// its namespace's Envoys, keys and config, and changes nothing. pprof
// (which can show anything in memory) wants an admin.
package admin

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
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/auth"
)

// Caller is who an admin API call comes from, as the admin listener
// proved it. The zero Caller sees nothing: it is what a context the admin
// listener did not vouch for holds.
type Caller struct {
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

type callerKey struct{}

// CallerFrom returns the caller of the admin call ctx belongs to, or the
// zero Caller (which sees nothing) if the admin listener did not decide it.
func CallerFrom(ctx context.Context) Caller {
	c, _ := ctx.Value(callerKey{}).(Caller)
	return c
}

// withCaller returns ctx carrying c: the admin listener alone vouches for
// a caller.
func withCaller(ctx context.Context, c Caller) context.Context {
	return context.WithValue(ctx, callerKey{}, c)
}

// String names the caller for logs and errors.
func (c Caller) String() string {
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
func (c Caller) SeesKey(key string) bool {
	return c.Admin || c.Namespace != "" && aggkey.Namespace(key) == c.Namespace
}

// MayAskNode reports whether the caller may ask for the node named id:
// an admin may ask for any; another caller for a node whose id names its
// namespace or none. It says nothing of whether the node exists, so a
// refusal reveals nothing; the answer's key (SeesKey) has the last word.
func (c Caller) MayAskNode(id string) bool {
	if c.Admin {
		return true
	}
	ns := auth.ConfigNamespace(&core.Node{Id: id})
	return c.Namespace != "" && (ns == "" || ns == c.Namespace)
}

// Authenticator proves who a caller is, from its call's context (a
// bearer token in its metadata, a client certificate in its peer).
type Authenticator interface {
	Authenticate(ctx context.Context) (auth.Identity, error)
}

// Guard decides who admin calls come from, by the rules above. Its fields
// are set once, before use; it is then safe for concurrent use.
type Guard struct {
	// Token, if set, makes an admin of a call that carries it
	// ("authorization: Bearer <token>"). A secret: never logged.
	Token string
	// Authenticator, if set, proves callers' identities: those in
	// Identities are admins, any other sees its own namespace.
	Authenticator Authenticator
	// Identities are the SPIFFE IDs of admins.
	Identities []string
	// XDSAuthenticated says the relay's xDS port authenticates: with
	// neither Token nor Authenticator, only a caller with a verified
	// client certificate is then an admin.
	XDSAuthenticated bool
	// Refuse returns the status of a failed authentication of what
	// (logging it, rate-limited): Unauthenticated with msg, or
	// Unavailable when the verifier could not decide. Nil: Unauthenticated.
	Refuse func(ctx context.Context, what, msg string, err error) error
}

// Caller decides who an admin call (of method, for logs) is from.
// Refusals name what was wrong with a credential, never the credential.
func (g *Guard) Caller(ctx context.Context, method string) (Caller, error) {
	if g.Token == "" && g.Authenticator == nil {
		if g.XDSAuthenticated && !handshakeVerified(ctx) {
			return Caller{}, status.Error(codes.Unauthenticated, "the admin API is closed: this relay authenticates its xDS port, and its admin listener has no --admin-identities, --admin-token-file or --admin-client-ca to prove callers with")
		}
		return Caller{Admin: true}, nil
	}
	if g.Token != "" {
		md, _ := metadata.FromIncomingContext(ctx)
		for _, v := range md.Get("authorization") {
			if g.tokenMatches(v) {
				return Caller{Admin: true}, nil
			}
		}
	}
	if g.Authenticator == nil {
		return Caller{}, status.Error(codes.Unauthenticated, "the admin API wants a bearer token (authorization: Bearer <token>)")
	}
	id, err := g.Authenticator.Authenticate(ctx)
	if err != nil {
		const want = "the admin API wants the admin token, a service-account token (authorization: Bearer) or a SPIFFE client certificate"
		if g.Refuse == nil {
			return Caller{}, status.Errorf(codes.Unauthenticated, "%s: %v", want, err)
		}
		return Caller{}, g.Refuse(ctx, "admin call "+method, want, err)
	}
	return g.IdentityCaller(id), nil
}

// handshakeVerified reports whether ctx's caller presented a client
// certificate its TLS handshake verified.
func handshakeVerified(ctx context.Context) bool {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return false
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	return ok && len(ti.State.VerifiedChains) > 0
}

// IdentityCaller is what a proven identity may do, on the admin API and
// in debug requests over xDS: everything if Identities names it, else see
// its own namespace.
func (g *Guard) IdentityCaller(id auth.Identity) Caller {
	spiffe := id.SPIFFEID()
	if slices.Contains(g.Identities, spiffe) {
		return Caller{Admin: true, Identity: spiffe}
	}
	return Caller{Namespace: id.Namespace, Identity: spiffe}
}

// tokenMatches reports whether an authorization header carries the admin
// token, in time that does not depend on where they differ.
func (g *Guard) tokenMatches(header string) bool {
	token, ok := strings.CutPrefix(header, "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(token), []byte(g.Token)) == 1
}

// NewServer returns a gRPC server every call of which but health checks
// is authenticated (Caller) and carries its caller in its context
// (CallerFrom).
func (g *Guard) NewServer(opts ...grpc.ServerOption) *grpc.Server {
	return grpc.NewServer(append(opts,
		grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			if isHealth(info.FullMethod) {
				return handler(ctx, req)
			}
			c, err := g.Caller(ctx, info.FullMethod)
			if err != nil {
				return nil, err
			}
			return handler(withCaller(ctx, c), req)
		}),
		grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
			if isHealth(info.FullMethod) {
				return handler(srv, ss)
			}
			c, err := g.Caller(ss.Context(), info.FullMethod)
			if err != nil {
				return err
			}
			return handler(srv, callerStream{ss, withCaller(ss.Context(), c)})
		}))...)
}

// Health checks need no credentials: kubelet's gRPC probes carry none,
// and readiness tells nothing secret.
func isHealth(method string) bool { return strings.HasPrefix(method, "/grpc.health.v1.Health/") }

// callerStream is a server stream whose context carries its Caller.
type callerStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s callerStream) Context() context.Context { return s.ctx }

// AdminsOnly lets through only admins (Caller, from the request's
// Authorization header and client certificate): 401 for a request that
// proves nothing, 403 for a caller scoped to a namespace, 503 while the
// verifier cannot decide.
func (g *Guard) AdminsOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		ctx := metadata.NewIncomingContext(req.Context(), metadata.MD{"authorization": req.Header.Values("Authorization")})
		p := &peer.Peer{}
		if req.TLS != nil {
			p.AuthInfo = credentials.TLSInfo{State: *req.TLS}
		}
		c, err := g.Caller(peer.NewContext(ctx, p), req.URL.Path)
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

// Handler sends gRPC requests to g and everything else to mux.
func Handler(g *grpc.Server, mux http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.ProtoMajor == 2 && strings.HasPrefix(req.Header.Get("Content-Type"), "application/grpc") {
			g.ServeHTTP(w, req)
			return
		}
		mux.ServeHTTP(w, req)
	})
}

// Protocols are HTTP/1 and HTTP/2, over TLS or cleartext (h2c: gRPC
// without TLS).
func Protocols() *http.Protocols {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	p.SetHTTP2(true)
	p.SetUnencryptedHTTP2(true)
	return p
}

// Health answers grpc.health.v1 with the relay's readiness: SERVING while
// Ready, until Stopping closes.
type Health struct {
	Ready    func() bool
	Stopping <-chan struct{}
}

func (h Health) status() healthpb.HealthCheckResponse_ServingStatus {
	if h.Ready() {
		return healthpb.HealthCheckResponse_SERVING
	}
	return healthpb.HealthCheckResponse_NOT_SERVING
}

// Check answers the relay's status (service "").
func (h Health) Check(_ context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	if req.GetService() != "" {
		return nil, status.Errorf(codes.NotFound, "unknown service %q: ask for \"\" (the relay)", req.GetService())
	}
	return &healthpb.HealthCheckResponse{Status: h.status()}, nil
}

// List answers the one service, "" (the relay).
func (h Health) List(context.Context, *healthpb.HealthListRequest) (*healthpb.HealthListResponse, error) {
	return &healthpb.HealthListResponse{Statuses: map[string]*healthpb.HealthCheckResponse{"": {Status: h.status()}}}, nil
}

// Watch sends the status, then every change of it (checked each second),
// until the caller leaves or the relay stops.
func (h Health) Watch(req *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
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
		case <-h.Stopping:
			return status.Error(codes.Unavailable, "relay stopping")
		case <-t.C:
		}
	}
}
