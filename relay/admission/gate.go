package admission

import (
	"context"
	"crypto/sha256"
	"net"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
)

// CredentialPrint identifies what a stream presents to prove itself (its
// authorization headers and TLS client certificate) without holding it:
// a SHA-256 of them.
type CredentialPrint [sha256.Size]byte

func PrintOf(ctx context.Context) CredentialPrint {
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
	var c CredentialPrint
	h.Sum(c[:0])
	return c
}

// FailureGate bounds the verifications failing credentials may cost. A
// credential that failed is refused unverified for BadFor: the same bad
// token retried (a pod whose token expired) costs nothing. Distinct
// credentials failing from one address are verified FailBurst times, then
// once a FailInterval, and past that refused unverified: a pod that
// makes up token after token neither burns CPU nor floods the Kubernetes
// API. A credential that authenticated lately is never held back, so a
// good client behind the same address (SNAT, hostNetwork pods) is not
// locked out by a bad neighbour, and a source that authenticates is not
// slowed. Bounded: at most MaxGateEntries addresses and as many
// credentials of each kind are remembered. Safe for concurrent use.
type FailureGate struct {
	mu   sync.Mutex
	by   map[netip.Addr]*rate.Limiter
	bad  map[CredentialPrint]badCredential
	good map[CredentialPrint]time.Time // → until when it passes the gate
	now  func() time.Time
}

// badCredential is a credential's failure, given again unverified until.
type badCredential struct {
	err   error
	until time.Time
}

const (
	FailBurst      = 5
	FailInterval   = time.Second
	BadFor         = 10 * time.Second
	GoodFor        = 10 * time.Minute
	MaxGateEntries = 10_000
)

// NewFailureGate returns an empty gate.
func NewFailureGate() *FailureGate {
	return &FailureGate{
		by:   make(map[netip.Addr]*rate.Limiter),
		bad:  make(map[CredentialPrint]badCredential),
		good: make(map[CredentialPrint]time.Time),
		now:  time.Now,
	}
}

// Allows reports whether a stream from ip presenting cred may be
// verified, or, for a credential that failed lately, its failure. For a
// source that failed recently it takes the verification's token now, so
// that concurrent streams of a flood cannot all pass before the first of
// them fails; a source that never failed is not counted.
func (g *FailureGate) Allows(ip netip.Addr, cred CredentialPrint) (ok bool, lately error) {
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

// Succeeded notes that cred authenticated; it passes the gate until it
// expires (zero: unknown), for GoodFor at most.
func (g *FailureGate) Succeeded(cred CredentialPrint, expires time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	until := g.now().Add(GoodFor)
	if !expires.IsZero() && expires.Before(until) {
		until = expires
	}
	delete(g.bad, cred)
	g.good[cred] = until
	prune(g.good, g.now(), func(until time.Time) time.Time { return until })
}

// Failed counts a failed authentication of cred from ip, which failed
// with err.
func (g *FailureGate) Failed(ip netip.Addr, cred CredentialPrint, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.good, cred)
	g.bad[cred] = badCredential{err: err, until: g.now().Add(BadFor)}
	prune(g.bad, g.now(), func(b badCredential) time.Time { return b.until })
	g.failedFromLocked(ip)
}

// FailedFrom counts a failure from ip of a credential that was good (a
// node another identity's): the address pays, not the credential.
func (g *FailureGate) FailedFrom(ip netip.Addr) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.failedFromLocked(ip)
}

func (g *FailureGate) failedFromLocked(ip netip.Addr) {
	if !ip.IsValid() {
		return
	}
	l := g.by[ip]
	if l == nil {
		if len(g.by) >= MaxGateEntries {
			// Forget the sources that stopped failing (full buckets);
			// if that frees less than half, forget them all: the bound
			// holds, and a flood from many addresses scans the map once
			// per MaxGateEntries/2 new ones, not at each.
			for a, old := range g.by {
				if old.Tokens() >= FailBurst {
					delete(g.by, a)
				}
			}
			if len(g.by) > MaxGateEntries/2 {
				clear(g.by)
			}
		}
		l = rate.NewLimiter(rate.Every(FailInterval), FailBurst)
		g.by[ip] = l
		l.Allow() // this failure; a known source paid in allows
	}
}

// prune keeps m under MaxGateEntries: once full, the entries past their
// time go, and all of them if that frees less than half.
func prune[V any](m map[CredentialPrint]V, now time.Time, until func(V) time.Time) {
	if len(m) < MaxGateEntries {
		return
	}
	for k, v := range m {
		if !now.Before(until(v)) {
			delete(m, k)
		}
	}
	if len(m) > MaxGateEntries/2 {
		clear(m)
	}
}

// SourceIP is the address a stream comes from (invalid if unknown).
func SourceIP(ctx context.Context) netip.Addr {
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
