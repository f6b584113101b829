package relay

import (
	"context"
	"net"
	"net/netip"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"golang.org/x/time/rate"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/auth"
)

// authMode names how the TLS port authenticates, for logs.
func (r *Relay) authMode() string {
	type moded interface{ Mode() auth.Mode }
	switch a := r.cfg.XDS.Authenticator.(type) {
	case nil:
		return string(auth.ModeNone)
	case moded:
		return string(a.Mode())
	}
	return "custom"
}

// authenticate proves the identity of a new Envoy stream on the TLS port
// (nil, nil elsewhere, or with no Authenticator). A refusal is
// Unauthenticated (Unavailable when the verifier could not ask the
// Kubernetes API) and counted by reason; it is logged at most a few times
// a second, naming the peer's address, never the credential.
func (r *Relay) authenticate(ctx context.Context, p port) (*auth.Identity, error) {
	if r.cfg.XDS.Authenticator == nil || p != portTLS {
		return nil, nil
	}
	id, err := r.cfg.XDS.Authenticator.Authenticate(ctx)
	if err != nil {
		reason := auth.ReasonOf(err)
		r.metrics.authFailures.WithLabelValues(string(reason)).Inc()
		if reason != auth.ReviewFailed {
			r.failures.failed(sourceIP(ctx))
		}
		return nil, r.refuseAuth(ctx, "stream", "authentication failed", err)
	}
	return &id, nil
}

// refuseAuth logs a failed authentication of what (at most a few a
// second, naming the peer's address, never the credential) and returns
// its status: Unavailable when the verifier could not reach what it asks
// (the Kubernetes API: the client is not at fault and should retry), else
// Unauthenticated with msg.
func (r *Relay) refuseAuth(ctx context.Context, what, msg string, err error) error {
	reason := auth.ReasonOf(err)
	if r.authLogs.Allow() {
		r.log.Warn(what+" refused: authentication failed", "peer", peerAddr(ctx), "reason", reason, "err", err)
	}
	if reason == auth.ReviewFailed {
		return status.Errorf(codes.Unavailable, "authentication unavailable: %v", err)
	}
	return status.Errorf(codes.Unauthenticated, "%s: %v", msg, err)
}

// checkIdentity applies istiod's rule to the node an authenticated stream
// presents: PermissionDenied, counted and logged (rate-limited) with the
// node id, if it is another namespace's or service account's.
func (s *stream) checkIdentity(node *core.Node) error {
	if s.identity == nil {
		return nil
	}
	if err := auth.CheckNode(*s.identity, node); err != nil {
		s.r.metrics.authFailures.WithLabelValues(string(auth.ReasonOf(err))).Inc()
		s.r.failures.failed(sourceIP(s.ctx))
		if s.r.authLogs.Allow() {
			s.log.Warn("stream refused: node does not match its identity", "node", node.GetId(), "peer", s.peer, "identity", s.identity.SPIFFEID(), "err", err)
		}
		return status.Errorf(codes.PermissionDenied, "authorization failed: %v", err)
	}
	return nil
}

func peerAddr(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return ""
}

// failureGate bounds the verifications a source address may cost while
// its authentications fail: each source may fail failBurst times, then
// once a failInterval; past that its streams are refused before anything
// is verified, and before they take a token of the admission bucket, so a
// pod that floods bad credentials neither burns CPU nor starves the
// others (in Kubernetes each pod has an address of its own). A source
// that authenticates is not slowed. Bounded: at most maxFailingSources
// addresses are remembered. Safe for concurrent use.
type failureGate struct {
	mu sync.Mutex
	by map[netip.Addr]*rate.Limiter
}

const (
	failBurst         = 5
	failInterval      = time.Second
	maxFailingSources = 10_000
)

func newFailureGate() *failureGate { return &failureGate{by: make(map[netip.Addr]*rate.Limiter)} }

// allows reports whether a stream from ip may be verified. For a source
// that failed recently it takes the verification's token now, so that
// concurrent streams of a flood cannot all pass before the first of them
// fails; a source that never failed is not counted.
func (g *failureGate) allows(ip netip.Addr) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	l := g.by[ip]
	return l == nil || l.Allow()
}

// failed counts a failed authentication from ip.
func (g *failureGate) failed(ip netip.Addr) {
	if !ip.IsValid() {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	l := g.by[ip]
	if l == nil {
		if len(g.by) >= maxFailingSources {
			// Forget the sources that stopped failing (full buckets);
			// if that frees less than half, forget them all: the bound
			// holds, and a flood from many addresses scans the map once
			// per maxFailingSources/2 new ones, not at each.
			for a, old := range g.by {
				if old.Tokens() >= failBurst {
					delete(g.by, a)
				}
			}
			if len(g.by) > maxFailingSources/2 {
				clear(g.by)
			}
		}
		l = rate.NewLimiter(rate.Every(failInterval), failBurst)
		g.by[ip] = l
		l.Allow() // this failure; a known source paid in allows
	}
}

// sourceIP is the address a stream comes from (invalid if unknown).
func sourceIP(ctx context.Context) netip.Addr {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return netip.Addr{}
	}
	if a, ok := p.Addr.(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	ap, err := netip.ParseAddrPort(p.Addr.String())
	if err != nil {
		return netip.Addr{}
	}
	return ap.Addr().Unmap()
}

// newAuthLogLimiter bounds authentication warnings: a flood of failures
// costs a counter each, not a log line each.
func newAuthLogLimiter() *rate.Limiter { return rate.NewLimiter(rate.Every(200*time.Millisecond), 10) }
