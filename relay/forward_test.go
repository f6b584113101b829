package relay

import (
	"context"
	"crypto/sha256"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/meshrelay/meshrelay/relay/xds"

	synth "github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/relay/auth/authtest"
)

func tokenHash(tok string) [32]byte { return sha256.Sum256([]byte(tok)) }

// forwardEnv is a relay in forward mode in front of an upstream that
// enforces istiod's identity rule.
func forwardEnv(t *testing.T, refresh time.Duration) (*secureEnv, *synth.Guard) {
	t.Helper()
	return forwardEnvMode(t, auth.ModeJWT, refresh, nil)
}

// forwardEnvMode is forwardEnv with the TLS port's --xds-auth mode, and
// the upstream's token verifier wrapped by upstreamTokens if set.
func forwardEnvMode(t *testing.T, mode auth.Mode, refresh time.Duration, upstreamTokens func(auth.TokenVerifier) auth.TokenVerifier) (*secureEnv, *synth.Guard) {
	t.Helper()
	issuer := authtest.NewIssuer(t)
	lcfg := auth.DefaultLocalConfig()
	lcfg.Issuer, lcfg.Keys = issuer.URL, auth.KeysFromFile(issuer.WriteJWKS(t))
	v, err := auth.NewLocal(context.Background(), lcfg)
	if err != nil {
		t.Fatal(err)
	}
	g := &synth.Guard{Tokens: v}
	if upstreamTokens != nil {
		g.Tokens = upstreamTokens(v)
	}
	e := newSecureEnvWith(t, mode, issuer, []grpc.ServerOption{grpc.ChainStreamInterceptor(g.Interceptor)}, func(c *Config) {
		c.Upstream.ForwardCredentials = true
		c.Upstream.TokenRefreshBefore = refresh
	})
	return e, g
}

// member connects one Envoy of ns1/app over TLS with its own token.
func (e *secureEnv) member(t *testing.T, i int, ttl time.Duration) (*rawClient, string, func()) {
	t.Helper()
	return e.memberOf(t, "ns1", i, ttl)
}

// memberOf connects one Envoy of ns/app over TLS with its own token.
func (e *secureEnv) memberOf(t *testing.T, ns string, i int, ttl time.Duration) (*rawClient, string, func()) {
	t.Helper()
	tok := e.issuer.Sign(t, authtest.Token{Namespace: ns, ServiceAccount: "app", TTL: ttl})
	conn := e.dial(t, creds{token: tok, perRPC: true})
	c := newRawClient(t, conn, true, saNode(ns, "app", i))
	c.subscribe(xds.TypeCluster, "*")
	if got := names(c.recvDelta(xds.TypeCluster)); len(got) != 3 {
		t.Fatalf("member %d of %s: clusters %v, want the 3 of %s", i, ns, got, ns)
	}
	c.quiet()
	return c, tok, func() { c.close(); conn.Close() }
}

// Several keys: the upstream sees exactly one stream per key, each
// presenting the node of one of that key's members and that member's own
// token, which the upstream verified; none presents another key's.
func TestForwardOneStreamPerKeyEachWithItsMembersToken(t *testing.T) {
	e, g := forwardEnv(t, time.Minute)
	type member struct{ node, ns string }
	byToken := map[[32]byte]member{}
	for _, ns := range []string{"ns1", "ns2"} {
		for i := range 3 {
			c, tok, closeC := e.memberOf(t, ns, i, time.Hour)
			defer closeC()
			byToken[tokenHash(tok)] = member{c.node.GetId(), ns}
		}
	}
	if n := len(e.r.cache.heldKeys()); n != 2 {
		t.Fatalf("keys = %d, want 2 (one per namespace)", n)
	}
	waitOpenUpstreams(t, e.up, 2)
	seen := g.Admitted()
	if len(seen) != 2 {
		t.Fatalf("upstream admitted %d streams %+v, want 2: one per key", len(seen), seen)
	}
	keys := map[string]bool{}
	for _, s := range seen {
		m, ok := byToken[s.Token]
		if !ok {
			t.Fatalf("an upstream stream presents a token no member brought (%x)", s.Token)
		}
		if s.Node != m.node {
			t.Fatalf("an upstream stream presents node %s with the token of %s", s.Node, m.node)
		}
		keys[m.ns] = true
	}
	if len(keys) != 2 {
		t.Fatalf("upstream streams present members of %v, want one of each namespace", keys)
	}
	if refused := g.Refused(); len(refused) > 0 {
		t.Fatalf("the upstream refused streams: %v", refused)
	}
}

// waitPresented waits until the upstream's latest admitted stream presents
// the token tok (and returns all it admitted).
func waitPresented(t *testing.T, g *synth.Guard, tok string, what string) []synth.GuardedStream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var seen []synth.GuardedStream
	waitCtx(ctx, t, what, func() bool {
		seen = g.Admitted()
		return len(seen) > 0 && seen[len(seen)-1].Token == tokenHash(tok)
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
	if len(seen) != 1 || seen[0].Node != a.node.GetId() {
		t.Fatalf("upstream streams %+v, want one presenting %s", seen, a.node.GetId())
	}
	if refused := g.Refused(); len(refused) > 0 {
		t.Fatalf("the upstream refused streams: %v", refused)
	}

	closeA()
	seen = waitPresented(t, g, tokB, "the stream re-homed to the second member's token")
	if last := seen[len(seen)-1]; last.Node != b.node.GetId() {
		t.Fatalf("re-homed stream presents %s, want %s (streams %+v, tokA %x tokB %x)", last.Node, b.node.GetId(), seen, tokenHash(tokA), tokenHash(tokB))
	}
	waitOpenUpstreams(t, e.up, 1)
	// Nothing reached the remaining member in between: its next response
	// is the barrier's, then exactly the change made now.
	b.quiet()
	e.up.set("ns1", xds.TypeCluster, mkCluster("c0"), mkCluster("c1"), mkCluster("c2"), mkCluster("c-new"))
	if got := names(b.recvDelta(xds.TypeCluster)); !slices.Equal(got, []string{"c-new"}) {
		t.Fatalf("after the re-home the member got %v, want only the new cluster", got)
	}
	b.ack(b.last)
	if refused := g.Refused(); len(refused) > 0 {
		t.Fatalf("the upstream refused streams: %v", refused)
	}
}

// A workload proven by its certificate forwards the token it sends beside
// it (istio-agent on a VM with a provisioned certificate sends both): the
// key's upstream stream presents that token, and not the node of a member
// that sent a certificate alone, which has nothing istiod would take.
func TestForwardTokenBesideACertificate(t *testing.T) {
	e, g := forwardEnvMode(t, auth.ModeAny, time.Minute, nil)
	cert := e.mesh.Workload(t, "cluster.local", "ns1", "app")
	tok := e.issuer.Sign(t, authtest.Token{Namespace: "ns1", ServiceAccount: "app", TTL: time.Hour})
	both := newRawClient(t, e.dial(t, creds{cert: cert, token: tok, perRPC: true}), true, saNode("ns1", "app", 1))
	both.subscribe(xds.TypeCluster, "*")
	if got := names(both.recvDelta(xds.TypeCluster)); len(got) != 3 {
		t.Fatalf("clusters %v, want the 3 of ns1", got)
	}
	certOnly := newRawClient(t, e.dial(t, creds{cert: cert}), true, saNode("ns1", "app", 2))
	certOnly.subscribe(xds.TypeCluster, "*")
	if got := names(certOnly.recvDelta(xds.TypeCluster)); len(got) != 3 {
		t.Fatalf("certificate-only member: clusters %v, want the 3 of ns1", got)
	}
	seen := waitPresented(t, g, tok, "the upstream admits a stream with the token sent beside the certificate")
	for _, s := range seen {
		if s.Node != both.node.GetId() {
			t.Fatalf("upstream streams %+v: one presents %s, want only %s", seen, s.Node, both.node.GetId())
		}
	}
	if refused := g.Refused(); len(refused) > 0 {
		t.Fatalf("the upstream refused streams: %v", refused)
	}
}

// revoked is the upstream's verifier, refusing some tokens the relay's
// verifier takes (a token bound to a pod that was deleted: the TokenReview
// istiod asks fails before the token's exp). Safe for concurrent use.
type revoked struct {
	auth.TokenVerifier
	mu      sync.Mutex
	tokens  map[[32]byte]bool
	refused int
}

func (r *revoked) revoke(tok string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.tokens[tokenHash(tok)] = true
}

func (r *revoked) VerifyToken(ctx context.Context, tok string) (auth.Identity, error) {
	r.mu.Lock()
	bad := r.tokens[tokenHash(tok)]
	if bad {
		r.refused++
	}
	r.mu.Unlock()
	if bad {
		return auth.Identity{}, errors.New("token revoked")
	}
	return r.TokenVerifier.VerifyToken(ctx, tok)
}

// A token the upstream refuses is not presented again: the key's next
// stream presents another member's token at once, rather than retrying the
// refused one with every backoff.
func TestForwardSkipsATokenTheUpstreamRefused(t *testing.T) {
	up := &revoked{tokens: map[[32]byte]bool{}}
	e, g := forwardEnvMode(t, auth.ModeJWT, time.Minute, func(v auth.TokenVerifier) auth.TokenVerifier {
		up.TokenVerifier = v
		return up
	})
	// The first member's token is good when it connects: the key's stream
	// presents it. Then its pod is deleted upstream (the token revoked)
	// and a second member joins; the key's stream breaks and must not
	// come back with the revoked token.
	a, tokA, closeA := e.member(t, 1, time.Hour)
	defer closeA()
	waitPresented(t, g, tokA, "the first member's token is presented")
	up.revoke(tokA)
	b, tokB, closeB := e.member(t, 2, time.Hour)
	defer closeB()
	// The upstream restarts: the stream must be opened again, with whose
	// token?
	e.up.stop()
	e.up.restart()
	seen := waitPresented(t, g, tokB, "the stream presents the second member's token")
	if last := seen[len(seen)-1]; last.Node != b.node.GetId() {
		t.Fatalf("stream presents %s, want %s", last.Node, b.node.GetId())
	}
	up.mu.Lock()
	refused := up.refused
	up.mu.Unlock()
	if refused > 1 {
		t.Fatalf("the upstream refused the revoked token %d times, want at most once", refused)
	}
	for _, c := range []*rawClient{a, b} {
		c.quiet()
	}
}

// A key whose members all left keeps its cache (Keys.IdleTimeout); if its
// stream breaks meanwhile, there is no token to present, and a stream
// without one would only be refused, again and again (issue 29: istiod
// logged "no HTTP authorization header" for such a key). The relay waits
// instead, and the next Envoy of the key brings the token its stream
// presents.
func TestForwardWaitsForATokenWhenNoMemberHasOne(t *testing.T) {
	e, g := forwardEnv(t, time.Minute)
	_, tokA, closeA := e.member(t, 1, time.Hour)
	waitPresented(t, g, tokA, "the member's token is presented")
	closeA()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	waitCtx(ctx, t, "the member left", func() bool { return e.r.Stats().Streams == 0 })
	e.up.stop()
	e.up.restart()
	// Either the relay waits for a token (the gauge), or it opened a
	// stream without one (the upstream refuses it).
	waitCtx(ctx, t, "the key's broken stream handled", func() bool {
		return testutil.ToFloat64(e.r.metrics.AwaitingToken) == 1 || len(g.Refused()) > 0
	})
	if refused := g.Refused(); len(refused) > 0 {
		t.Fatalf("with no member's token to present the relay opened streams the upstream refused: %v", refused)
	}
	b, tokB, closeB := e.member(t, 2, time.Hour)
	defer closeB()
	seen := waitPresented(t, g, tokB, "the next member's token is presented")
	if last := seen[len(seen)-1]; last.Node != b.node.GetId() {
		t.Fatalf("stream presents %s, want %s", last.Node, b.node.GetId())
	}
	if got := testutil.ToFloat64(e.r.metrics.AwaitingToken); got != 0 {
		t.Fatalf("keys awaiting a token = %v once a member brought one, want 0", got)
	}
	if refused := g.Refused(); len(refused) > 0 {
		t.Fatalf("the upstream refused streams: %v", refused)
	}
	b.quiet()
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
	if last := seen[len(seen)-1]; last.Node != b.node.GetId() {
		t.Fatalf("stream presents %s, want %s", last.Node, b.node.GetId())
	}
	waitOpenUpstreams(t, e.up, 1)
	for _, c := range []*rawClient{a, b} {
		c.quiet()
	}
	if refused := g.Refused(); len(refused) > 0 {
		t.Fatalf("the upstream refused streams: %v", refused)
	}
}

func waitOpenUpstreams(t *testing.T, up *testUpstream, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	waitCtx(ctx, t, "upstream streams open", func() bool { open, _ := up.streams(); return open == n })
}

// An Envoy whose token nears its expiry is asked to reconnect (its
// connection closed), so that the key keeps a token istiod takes; with a
// fresh token it is served again at once, and the upstream stream moves
// to it when the old one can no longer be presented.
func TestForwardAsksExpiringTokensToReconnect(t *testing.T) {
	const refresh = 6 * time.Second
	e, g := forwardEnv(t, refresh)
	// Within half the refresh margin of its expiry after a second; moved
	// once it has been open half the margin.
	old, tokOld, closeOld := e.member(t, 1, refresh/2+time.Second)
	defer closeOld()
	waitPresented(t, g, tokOld, "the member's token is presented")
	if err := old.streamErr(); status.Code(err) != codes.Unavailable {
		t.Fatalf("the stream with the expiring token ended with %v, want Unavailable (connection closed)", err)
	}
	if got := testutil.ToFloat64(e.r.metrics.Shed.WithLabelValues("token_expiry")); got != 1 {
		t.Fatalf("streams moved for token expiry = %v, want 1", got)
	}
	// istio-agent reconnects with the token it holds now.
	_, tokNew, closeNew := e.member(t, 1, time.Hour)
	defer closeNew()
	waitPresented(t, g, tokNew, "the reconnected member's fresh token is presented")
	if refused := g.Refused(); len(refused) > 0 {
		t.Fatalf("the upstream refused streams: %v", refused)
	}
}

// A type the relay does not aggregate passes through on a stream of the
// client's own (passthrough.go), which presents the client's own token and
// node, as the client would to istiod, never none (issue 29: istiod
// refused every such stream, 33 times a minute). A client whose token the
// upstream refuses hears the refusal on its stream, once, instead of the
// relay retrying it with every backoff.
func TestForwardPassthroughPresentsTheClientsToken(t *testing.T) {
	up := &revoked{tokens: map[[32]byte]bool{}}
	issuer := authtest.NewIssuer(t)
	lcfg := auth.DefaultLocalConfig()
	lcfg.Issuer, lcfg.Keys = issuer.URL, auth.KeysFromFile(issuer.WriteJWKS(t))
	v, err := auth.NewLocal(context.Background(), lcfg)
	if err != nil {
		t.Fatal(err)
	}
	up.TokenVerifier = v
	g := &synth.Guard{Tokens: up}
	e := newSecureEnvWith(t, auth.ModeJWT, issuer, []grpc.ServerOption{grpc.ChainStreamInterceptor(g.Interceptor)}, func(c *Config) {
		c.Upstream.ForwardCredentials, c.Upstream.TokenRefreshBefore = true, time.Minute
		// No divergence check: it would present a's token too, and this
		// test counts who presents it.
		c.Keys.DivergenceInterval = 0
	})
	e.up.set("ns1", typeOther, &structpb.Struct{Fields: map[string]*structpb.Value{"host": structpb.NewStringValue("c0.ns1")}})
	// c joins first: the key's stream presents c's token throughout.
	_, tokC, closeC := e.member(t, 3, time.Hour)
	defer closeC()
	waitPresented(t, g, tokC, "the key's stream presents the first member's token")
	a, tokA, closeA := e.member(t, 1, time.Hour)
	defer closeA()
	b, tokB, closeB := e.member(t, 2, time.Hour)
	defer closeB()
	b.subscribe(typeOther)
	if m := b.recvDelta(typeOther); len(m.GetResources()) != 1 {
		t.Fatalf("a passthrough type through the relay: %d resources, want 1", len(m.GetResources()))
	}
	seen := waitPresented(t, g, tokB, "the passthrough stream presents the second member's own token")
	if last := seen[len(seen)-1]; last.Node != b.node.GetId() {
		t.Fatalf("the passthrough stream presents node %s, want its client's %s", last.Node, b.node.GetId())
	}
	if refused := g.Refused(); len(refused) > 0 {
		t.Fatalf("the upstream refused streams: %v", refused)
	}

	// The upstream refuses a's token from now on (its pod is gone): a's
	// passthrough stream is refused, and a is told so.
	up.revoke(tokA)
	a.subscribe(typeOther)
	if err := a.streamErr(); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("a client whose own upstream stream is refused: %v, want Unauthenticated", err)
	}
	up.mu.Lock()
	refused := up.refused
	up.mu.Unlock()
	if refused != 1 {
		t.Fatalf("the upstream refused the revoked token %d times, want once", refused)
	}
}

// Passthrough streams (one per client, for the types the relay does not
// aggregate) open at the upstream's pace, a fifth of it at most, like
// every upstream stream the relay opens: a client's second stream asking
// such a type waits for the limiter rather than adding to a storm (issue
// 29: 150 streams of a key opened 151 upstream streams at once).
func TestPassthroughStreamsWaitTheirTurn(t *testing.T) {
	e := newEnv(t, true, nil)
	// One passthrough stream now, the next in 1,000 s: the test ends
	// long before.
	e.r.srv.passRate = rate.NewLimiter(0.001, 1)
	first := e.client(10)
	first.subscribe(xds.TypeCluster)
	first.ack(first.recv())
	first.subscribe(typeOther)
	if m := first.recvDelta(typeOther); len(m.GetResources()) != 1 {
		t.Fatalf("first client's passthrough type: %d resources, want 1", len(m.GetResources()))
	}
	_, before := e.up.streams()
	second := e.client(11)
	second.subscribe(xds.TypeCluster)
	second.ack(second.recv())
	second.subscribe(typeOther)
	second.quiet(typeOther) // its passthrough request was handled before this barrier's
	if _, after := e.up.streams(); after != before {
		t.Fatalf("upstream streams opened while the passthrough limiter was empty: %d, want %d", after, before)
	}
}
