package relay

import (
	"context"
	"crypto/sha256"
	"slices"
	"sync"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

// istiodGuard checks every stream as istiod's 15012 does: a verified
// service-account token, and a first request whose node is of its
// identity (auth.CheckNode). It records what each admitted stream
// presented.
type istiodGuard struct {
	tokens auth.TokenVerifier

	mu      sync.Mutex
	streams []guardedStream
	refused []error
}

type guardedStream struct {
	token [32]byte // the token's hash: which member's token it was
	node  string
}

func (g *istiodGuard) interceptor(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	tok, err := auth.BearerToken(ss.Context())
	if err == nil && tok == "" {
		err = &auth.Error{Reason: auth.NoCredentials, Err: errNoToken}
	}
	var id auth.Identity
	if err == nil {
		id, err = g.tokens.VerifyToken(ss.Context(), tok)
	}
	if err != nil {
		g.refuse(err)
		return status.Errorf(codes.Unauthenticated, "authentication failure: %v", err)
	}
	return handler(srv, &guardedServerStream{ServerStream: ss, g: g, id: id, token: sha256.Sum256([]byte(tok))})
}

var errNoToken = status.Error(codes.Unauthenticated, "no token")

func (g *istiodGuard) refuse(err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.refused = append(g.refused, err)
}

func (g *istiodGuard) seen() ([]guardedStream, []error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.streams), slices.Clone(g.refused)
}

type guardedServerStream struct {
	grpc.ServerStream
	g       *istiodGuard
	id      auth.Identity
	token   [32]byte
	checked bool
}

func (s *guardedServerStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	if s.checked {
		return nil
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
	s.g.streams = append(s.g.streams, guardedStream{token: s.token, node: n.GetId()})
	s.g.mu.Unlock()
	return nil
}

func tokenHash(tok string) [32]byte { return sha256.Sum256([]byte(tok)) }

// forwardEnv is a relay in forward mode in front of an upstream that
// enforces istiod's identity rule.
func forwardEnv(t *testing.T, refresh time.Duration) (*secureEnv, *istiodGuard) {
	t.Helper()
	issuer := authtest.NewIssuer(t)
	lcfg := auth.DefaultLocalConfig()
	lcfg.Issuer, lcfg.Keys = issuer.URL, auth.KeysFromFile(issuer.WriteJWKS(t))
	v, err := auth.NewLocal(context.Background(), lcfg)
	if err != nil {
		t.Fatal(err)
	}
	g := &istiodGuard{tokens: v}
	e := newSecureEnvWith(t, auth.ModeJWT, issuer, []grpc.ServerOption{grpc.ChainStreamInterceptor(g.interceptor)}, func(c *Config) {
		c.ForwardCredentials = true
		c.TokenRefreshBefore = refresh
	})
	return e, g
}

// member connects one Envoy of ns1/app over TLS with its own token.
func (e *secureEnv) member(t *testing.T, i int, ttl time.Duration) (*rawClient, string, func()) {
	t.Helper()
	tok := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app", TTL: ttl})
	conn := e.dial(t, creds{token: tok, perRPC: true})
	c := newRawClient(t, conn, true, saNode("ns1", "app", i))
	c.subscribe(typeCluster, "*")
	if got := names(c.recvDelta(typeCluster)); len(got) != 3 {
		t.Fatalf("member %d: clusters %v, want the 3 of ns1", i, got)
	}
	c.quiet()
	return c, tok, func() { c.close(); conn.Close() }
}

// waitPresented waits until the upstream's latest admitted stream presents
// the token tok (and returns all it admitted).
func waitPresented(t *testing.T, g *istiodGuard, tok string, what string) []guardedStream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var seen []guardedStream
	waitCtx(ctx, t, what, func() bool {
		seen, _ = g.seen()
		return len(seen) > 0 && seen[len(seen)-1].token == tokenHash(tok)
	})
	return seen
}

// Forward mode: the upstream, checking tokens and nodes as istiod does,
// sees one stream per key, carrying a member's valid token and that
// member's node. When the member leaves, the stream moves to another
// member's node and token, and the Envoys still connected see nothing of it.
func TestForwardPresentsAMembersToken(t *testing.T) {
	e, g := forwardEnv(t, time.Minute)
	a, tokA, closeA := e.member(t, 1, time.Hour)
	b, tokB, closeB := e.member(t, 2, time.Hour)
	defer closeB()
	seen := waitPresented(t, g, tokA, "the upstream admits a stream with the first member's token")
	if len(seen) != 1 || seen[0].node != a.node.GetId() {
		t.Fatalf("upstream streams %+v, want one presenting %s", seen, a.node.GetId())
	}
	if _, refused := g.seen(); len(refused) > 0 {
		t.Fatalf("the upstream refused streams: %v", refused)
	}

	closeA()
	seen = waitPresented(t, g, tokB, "the stream re-homed to the second member's token")
	if last := seen[len(seen)-1]; last.node != b.node.GetId() {
		t.Fatalf("re-homed stream presents %s, want %s (streams %+v, tokA %x tokB %x)", last.node, b.node.GetId(), seen, tokenHash(tokA), tokenHash(tokB))
	}
	waitOpenUpstreams(t, e.up, 1)
	// Nothing reached the remaining member in between: its next response
	// is the barrier's, then exactly the change made now.
	b.quiet()
	e.up.set("ns1", typeCluster, mkCluster("c0"), mkCluster("c1"), mkCluster("c2"), mkCluster("c-new"))
	if got := names(b.recvDelta(typeCluster)); !slices.Equal(got, []string{"c-new"}) {
		t.Fatalf("after the re-home the member got %v, want only the new cluster", got)
	}
	b.ack(b.last)
	if _, refused := g.seen(); len(refused) > 0 {
		t.Fatalf("the upstream refused streams: %v", refused)
	}
}

// A token near its expiry is replaced before istiod would refuse it: the
// stream moves to a member whose token lives longer, with no change for
// either Envoy.
func TestForwardRehomesBeforeTheTokenExpires(t *testing.T) {
	const refresh = time.Hour
	e, g := forwardEnv(t, refresh)
	// A's token is within the refresh margin a few seconds from now; it is
	// presented while it is the key's only member.
	a, tokA, closeA := e.member(t, 1, refresh+3*time.Second)
	defer closeA()
	waitPresented(t, g, tokA, "the only member's token is presented")
	b, tokB, closeB := e.member(t, 2, 3*time.Hour)
	defer closeB()
	seen := waitPresented(t, g, tokB, "the stream moved to the longer-lived token")
	if last := seen[len(seen)-1]; last.node != b.node.GetId() {
		t.Fatalf("stream presents %s, want %s", last.node, b.node.GetId())
	}
	waitOpenUpstreams(t, e.up, 1)
	for _, c := range []*rawClient{a, b} {
		c.quiet()
	}
	if _, refused := g.seen(); len(refused) > 0 {
		t.Fatalf("the upstream refused streams: %v", refused)
	}
}

func waitOpenUpstreams(t *testing.T, up *testUpstream, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	waitCtx(ctx, t, "upstream streams open", func() bool { open, _ := up.streams(); return open == n })
}
