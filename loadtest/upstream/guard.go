package upstream

import (
	"crypto/sha256"
	"errors"
	"slices"
	"sync"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/auth"
)

// Guard checks every ADS stream as istiod does on its port 15012: the
// stream's service-account token must verify (Unauthenticated otherwise),
// and the node of its first request must be of the token's namespace and
// service account (checkConnectionIdentity: PermissionDenied otherwise).
// It records what each admitted stream presented. Install it with
// Config.ServerOptions = []grpc.ServerOption{grpc.ChainStreamInterceptor(g.Interceptor)}.
// Safe for concurrent use.
type Guard struct {
	// Tokens verifies the tokens (auth.NewLocal against the test's issuer).
	Tokens auth.TokenVerifier

	mu       sync.Mutex
	admitted []GuardedStream
	refused  []error
}

// GuardedStream is what an admitted stream presented.
type GuardedStream struct {
	// Token is the SHA-256 of the token (the Guard keeps no token).
	Token [sha256.Size]byte
	// Node is the id of the node of its first request.
	Node string
}

// Interceptor is the Guard as a gRPC stream interceptor.
func (g *Guard) Interceptor(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	tok, err := auth.BearerToken(ss.Context())
	if err == nil && tok == "" {
		err = errors.New("no authorization: Bearer token")
	}
	var id auth.Identity
	if err == nil {
		id, err = g.Tokens.VerifyToken(ss.Context(), tok)
	}
	if err != nil {
		g.refuse(err)
		return status.Errorf(codes.Unauthenticated, "authentication failure: %v", err)
	}
	return handler(srv, &guardedStream{ServerStream: ss, g: g, id: id, token: sha256.Sum256([]byte(tok))})
}

// Admitted returns the streams admitted so far, in order.
func (g *Guard) Admitted() []GuardedStream {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.admitted)
}

// Refused returns why streams were refused, in order.
func (g *Guard) Refused() []error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.refused)
}

func (g *Guard) refuse(err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.refused = append(g.refused, err)
}

type guardedStream struct {
	grpc.ServerStream
	g       *Guard
	id      auth.Identity
	token   [sha256.Size]byte
	checked bool
}

func (s *guardedStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil || s.checked {
		return err
	}
	s.checked = true
	var n *core.Node
	switch r := m.(type) {
	case *discovery.DeltaDiscoveryRequest:
		n = r.GetNode()
	case *discovery.DiscoveryRequest:
		n = r.GetNode()
	}
	if err := auth.CheckNode(s.id, n); err != nil {
		s.g.refuse(err)
		return status.Errorf(codes.PermissionDenied, "authorization failed: %v", err)
	}
	s.g.mu.Lock()
	s.g.admitted = append(s.g.admitted, GuardedStream{Token: s.token, Node: n.GetId()})
	s.g.mu.Unlock()
	return nil
}
