package relay

import (
	"context"
	"crypto/sha256"
	"net"
	"net/netip"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"golang.org/x/time/rate"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
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
// a second, naming the peer's address, never the credential. Streams that
// present the same credential at once share one verification, and the
// failure gate bounds what failing ones cost (failureGate).
func (r *Relay) authenticate(ctx context.Context, p port) (*auth.Identity, error) {
	if r.cfg.XDS.Authenticator == nil || p != portTLS {
		return nil, nil
	}
	ip, cred := sourceIP(ctx), credentialPrintOf(ctx)
	ok, lately := r.failures.allows(ip, cred)
	if lately != nil {
		// Refused as it was a moment ago, unverified.
		r.metrics.authFailures.WithLabelValues(string(auth.ReasonOf(lately))).Inc()
		return nil, r.refuseAuth(ctx, "stream", "authentication failed", lately)
	}
	if !ok {
		r.metrics.authFailures.WithLabelValues("throttled").Inc()
		return nil, status.Error(codes.Unauthenticated, "too many failed authentications from this address: retry later")
	}
	v, err, _ := r.verifying.Do(string(cred[:]), func() (any, error) {
		// Shared: the first stream going away must not fail the others.
		vctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), verifyTimeout)
		defer cancel()
		return r.cfg.XDS.Authenticator.Authenticate(vctx)
	})
	if err != nil {
		reason := auth.ReasonOf(err)
		r.metrics.authFailures.WithLabelValues(string(reason)).Inc()
		if reason != auth.ReviewFailed {
			r.failures.failed(ip, cred, err)
		}
		return nil, r.refuseAuth(ctx, "stream", "authentication failed", err)
	}
	id := v.(auth.Identity)
	r.failures.succeeded(cred, id.Expires)
	return &id, nil
}

// verifyTimeout bounds one verification, which the streams presenting
// the same credential at once share.
const verifyTimeout = 30 * time.Second

// credentialPrint identifies what a stream presents to prove itself (its
// authorization headers and TLS client certificate) without holding it:
// a SHA-256 of them.
type credentialPrint [sha256.Size]byte

func credentialPrintOf(ctx context.Context) credentialPrint {
	h := sha256.New()
	md, _ := metadata.FromIncomingContext(ctx)
	for _, v := range md.Get("authorization") {
		h.Write([]byte(v))
		h.Write([]byte{0})
	}
	if p, ok := peer.FromContext(ctx); ok {
		if ti, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(ti.State.PeerCertificates) > 0 {
			h.Write(ti.State.PeerCertificates[0].Raw)
		}
	}
	var c credentialPrint
	h.Sum(c[:0])
	return c
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
		s.r.failures.failedFrom(sourceIP(s.ctx))
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

// failureGate bounds the verifications failing credentials may cost. A
// credential that failed is refused unverified for badFor: the same bad
// token retried (a pod whose token expired) costs nothing. Distinct
// credentials failing from one address are verified failBurst times, then
// once a failInterval, and past that refused unverified: a pod that
// makes up token after token neither burns CPU nor floods the Kubernetes
// API. A credential that authenticated lately is never held back, so a
// good client behind the same address (SNAT, hostNetwork pods) is not
// locked out by a bad neighbour, and a source that authenticates is not
// slowed. Bounded: at most maxGateEntries addresses and as many
// credentials of each kind are remembered. Safe for concurrent use.
type failureGate struct {
	mu   sync.Mutex
	by   map[netip.Addr]*rate.Limiter
	bad  map[credentialPrint]badCredential
	good map[credentialPrint]time.Time // → until when it passes the gate
	now  func() time.Time
}

// badCredential is a credential's failure, given again unverified until.
type badCredential struct {
	err   error
	until time.Time
}

const (
	failBurst      = 5
	failInterval   = time.Second
	badFor         = 10 * time.Second
	goodFor        = 10 * time.Minute
	maxGateEntries = 10_000
)

func newFailureGate() *failureGate {
	return &failureGate{
		by:   make(map[netip.Addr]*rate.Limiter),
		bad:  make(map[credentialPrint]badCredential),
		good: make(map[credentialPrint]time.Time),
		now:  time.Now,
	}
}

// allows reports whether a stream from ip presenting cred may be
// verified, or, for a credential that failed lately, its failure. For a
// source that failed recently it takes the verification's token now, so
// that concurrent streams of a flood cannot all pass before the first of
// them fails; a source that never failed is not counted.
func (g *failureGate) allows(ip netip.Addr, cred credentialPrint) (ok bool, lately error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	if until, ok := g.good[cred]; ok && now.Before(until) {
		return true, nil
	}
	if b, ok := g.bad[cred]; ok && now.Before(b.until) {
		return false, b.err
	}
	l := g.by[ip]
	return l == nil || l.Allow(), nil
}

// succeeded notes that cred authenticated; it passes the gate until it
// expires (zero: unknown), for goodFor at most.
func (g *failureGate) succeeded(cred credentialPrint, expires time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	until := g.now().Add(goodFor)
	if !expires.IsZero() && expires.Before(until) {
		until = expires
	}
	delete(g.bad, cred)
	g.good[cred] = until
	prune(g.good, g.now(), func(until time.Time) time.Time { return until })
}

// failed counts a failed authentication of cred from ip, which failed
// with err.
func (g *failureGate) failed(ip netip.Addr, cred credentialPrint, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.good, cred)
	g.bad[cred] = badCredential{err: err, until: g.now().Add(badFor)}
	prune(g.bad, g.now(), func(b badCredential) time.Time { return b.until })
	g.failedFromLocked(ip)
}

// failedFrom counts a failure from ip of a credential that was good (a
// node another identity's): the address pays, not the credential.
func (g *failureGate) failedFrom(ip netip.Addr) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.failedFromLocked(ip)
}

func (g *failureGate) failedFromLocked(ip netip.Addr) {
	if !ip.IsValid() {
		return
	}
	l := g.by[ip]
	if l == nil {
		if len(g.by) >= maxGateEntries {
			// Forget the sources that stopped failing (full buckets);
			// if that frees less than half, forget them all: the bound
			// holds, and a flood from many addresses scans the map once
			// per maxGateEntries/2 new ones, not at each.
			for a, old := range g.by {
				if old.Tokens() >= failBurst {
					delete(g.by, a)
				}
			}
			if len(g.by) > maxGateEntries/2 {
				clear(g.by)
			}
		}
		l = rate.NewLimiter(rate.Every(failInterval), failBurst)
		g.by[ip] = l
		l.Allow() // this failure; a known source paid in allows
	}
}

// prune keeps m under maxGateEntries: once full, the entries past their
// time go, and all of them if that frees less than half.
func prune[V any](m map[credentialPrint]V, now time.Time, until func(V) time.Time) {
	if len(m) < maxGateEntries {
		return
	}
	for k, v := range m {
		if !now.Before(until(v)) {
			delete(m, k)
		}
	}
	if len(m) > maxGateEntries/2 {
		clear(m)
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
