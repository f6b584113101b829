package relay

import (
	"context"
	"errors"
	"math"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/peers"
)

// Balancer tells the relay its fair share of Envoy streams. shard.Ring
// implements it. Implementations must be safe for concurrent use.
type Balancer interface {
	// FairShare records this relay's Envoy stream count and returns the
	// tier's streams per relay and the count of the least loaded relay; ok
	// is false while the relay knows of no other.
	FairShare(conns int) (share, least int, ok bool)
}

// maxKeyLen bounds a key named by a peer.
const maxKeyLen = 1024

// identifyPeer reads a relay-to-relay stream's metadata. It returns nil for
// an ordinary client stream, and an error for a peer stream that does not
// prove itself.
func (r *Relay) identifyPeer(ctx context.Context, p port) (*peerIdentity, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	ids := md.Get(peers.MDRelay)
	if len(ids) == 0 {
		return nil, nil
	}
	keys := md.Get(peers.MDKey)
	if len(ids) != 1 || len(keys) != 1 || ids[0] == "" || keys[0] == "" || len(keys[0]) > maxKeyLen {
		return nil, status.Error(codes.InvalidArgument, "relay-to-relay stream: want exactly one peer id and one key")
	}
	if err := r.provePeer(ctx, md, p, ids[0], "relay-to-relay stream"); err != nil {
		return nil, err
	}
	pi := &peerIdentity{id: ids[0], key: aggkey.Key(keys[0])}
	if d := md.Get(peers.MDDemand); len(d) == 1 {
		s, err := ledger.ParseStamp(d[0])
		if err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "relay-to-relay stream: %s: %v", peers.MDDemand, err)
		}
		pi.demand = s
	}
	if v := md.Get(peers.MDSplits); len(v) == 1 {
		splits, err := aggkey.DecodeSplits([]byte(v[0]))
		if err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "relay-to-relay stream: %s: %v", peers.MDSplits, err)
		}
		pi.splits = splits
	}
	return pi, nil
}

// provePeer checks that a stream or call (what) on port p that names
// itself relay id is one: by the client certificate of the peer port's
// mTLS handshake, else by a proof of the tier's peer secret in md (fresh,
// never seen before, for this method and key: peers.Verifier), else (no
// secret) by the network, but never on the authenticating TLS port, where
// believing it would skip authentication.
//
// Every relay of a tier presents the tier's one certificate (one SPIFFE
// ID, auth.PeerTLS) and holds the one secret, so neither names a relay:
// id is a label (logs, claims, the ledger's who-is-who), not an identity.
// That costs nothing: whoever holds the tier's certificate or secret may
// already subscribe to every key and answer every gather as itself.
func (r *Relay) provePeer(ctx context.Context, md metadata.MD, p port, id, what string) error {
	switch {
	case r.peerProvenByTLS(p):
		if err := r.peerCertified(ctx); err != nil {
			r.refusePeer(ctx, what, id, err)
			return status.Errorf(codes.Unauthenticated, "%s: %v", what, err)
		}
		return nil
	case r.unprovenPeer(p):
		r.metrics.AuthFailures.WithLabelValues("unproven_peer").Inc()
		return status.Errorf(codes.Unauthenticated, "%s on the TLS port needs the tier's peer secret", what)
	case len(r.cfg.Tier.Secret) == 0:
		return nil
	}
	err := errPeerProofs
	if proofs := md.Get(peers.MDAuth); len(proofs) == 1 {
		method, _ := grpc.Method(ctx)
		v := peers.Verifier{Secret: r.cfg.Tier.Secret, Replays: r.pool.Replays()}
		err = v.Verify(proofs[0], id, method, peers.OneValue(md, peers.MDKey))
	}
	if err != nil {
		r.refusePeer(ctx, what, id, err)
		return status.Errorf(codes.Unauthenticated, "%s: %v", what, err)
	}
	return nil
}

var errPeerProofs = errors.New("want one peer proof (" + peers.MDAuth + ")")

// peerCertified checks that a call on the mTLS peer port came with a
// client certificate that Tier.TLS verified: whatever that config asks of
// clients, a call without one, or with one nothing checked, is no relay's.
// Verified means a chain the handshake built, or a verification callback
// on Tier.TLS (auth.PeerTLS's checks the chain and the SPIFFE ID there).
func (r *Relay) peerCertified(ctx context.Context) error {
	pr, ok := peer.FromContext(ctx)
	if !ok {
		return errNoPeerCert
	}
	ti, ok := pr.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.PeerCertificates) == 0 {
		return errNoPeerCert
	}
	tc := r.cfg.Tier.TLS
	if len(ti.State.VerifiedChains) == 0 && tc.VerifyConnection == nil && tc.VerifyPeerCertificate == nil {
		return errors.New("the peer port's TLS config verified no client certificate (Tier.TLS: use auth.PeerTLS)")
	}
	return nil
}

var errNoPeerCert = errors.New("no client certificate: relays present the tier's")

// refusePeer logs, rate-limited, a relay-to-relay call refused for its
// proof. The proof itself is never logged.
func (r *Relay) refusePeer(ctx context.Context, what, id string, err error) {
	if r.srv.authLogs.Allow() {
		r.log.Warn(what+" refused: bad peer proof", "peer_relay", id, "peer", peerAddr(ctx), "err", err)
	}
}

// asPeer returns ctx whose calls and streams on the relay's pool name this
// relay and, with a peer secret, carry a fresh proof each.
func (r *Relay) asPeer(ctx context.Context) context.Context {
	ctx = metadata.AppendToOutgoingContext(ctx, peers.MDRelay, r.cfg.ID)
	if len(r.cfg.Tier.Secret) > 0 {
		ctx = peers.WithProver(ctx, peers.Prover{Secret: r.cfg.Tier.Secret, ID: r.cfg.ID})
	}
	return ctx
}

// peerContext adds the metadata of a stream this relay opens to a peer.
func (r *Relay) peerContext(ctx context.Context, key aggkey.Key) context.Context {
	kv := []string{peers.MDKey, string(key)}
	if splits := r.cache.splits.of(key); len(splits) > 0 {
		kv = append(kv, peers.MDSplits, string(aggkey.EncodeSplits(splits)))
	}
	return metadata.AppendToOutgoingContext(r.asPeer(ctx), kv...)
}

// watchOwners wakes every key's feed when owners may have
// moved, so that each checks its source.
func (r *Relay) watchOwners(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.cfg.Tier.Owners.Changed():
		}
		r.cache.ownersTerm.Add(1)
		for _, k := range r.cache.heldKeys() {
			wake(k.upWake)
		}
	}
}

// connTracker remembers the server's connections by remote address, so that
// a stream's connection can be closed to move its client elsewhere. It
// hands grpc-go the connections unwrapped: a wrapped net.Conn cost about
// 60 KB a connection in the relay's peak RSS (measured at 1,000 SotW
// Envoys: 372 and 390 MiB wrapped, 303 and 333 MiB not). So it does not see
// connections close; prune forgets those that no stream uses.
type connTracker struct {
	mu    sync.Mutex
	conns map[string]trackedConn
}

// trackedListener adds the connections it accepts to a connTracker.
type trackedListener struct {
	net.Listener
	t *connTracker
}

type trackedConn struct {
	net.Conn
	at time.Time // accepted
}

func newConnTracker() *connTracker {
	return &connTracker{conns: make(map[string]trackedConn)}
}

// track returns l, its connections tracked by t.
func (t *connTracker) track(l net.Listener) net.Listener { return trackedListener{l, t} }

func (l trackedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.t.mu.Lock()
	l.t.conns[c.RemoteAddr().String()] = trackedConn{Conn: c, at: time.Now()}
	l.t.mu.Unlock()
	return c, nil
}

// take forgets the connection from addr and returns it (nil if none).
func (t *connTracker) take(addr string) net.Conn {
	t.mu.Lock()
	defer t.mu.Unlock()
	c, ok := t.conns[addr]
	if !ok {
		return nil
	}
	delete(t.conns, addr)
	return c.Conn
}

// prune forgets the connections accepted more than grace ago that no
// stream uses (live lists the remote addresses of the streams).
func (t *connTracker) prune(live map[string]bool, grace time.Duration) {
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	for addr, c := range t.conns {
		if !live[addr] && now.Sub(c.at) > grace {
			delete(t.conns, addr)
		}
	}
}

// every calls fn every d until ctx ends (not at once).
func every(ctx context.Context, d time.Duration, fn func()) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		fn()
	}
}

// pruneConns forgets, every minute, the connections no stream uses.
func (r *Relay) pruneConns(ctx context.Context) {
	every(ctx, time.Minute, func() {
		envoys, peers := r.streams()
		live := make(map[string]bool, len(envoys)+len(peers))
		for _, s := range append(envoys, peers...) {
			live[s.peer] = true
		}
		r.tracker.prune(live, time.Minute)
	})
}

// streams returns the attached streams, Envoys' and other relays' apart.
func (r *Relay) streams() (envoys, peers []*stream) {
	for s := range r.srv.attachedStreams() {
		if s.peerRelay == nil {
			envoys = append(envoys, s)
		} else {
			peers = append(peers, s)
		}
	}
	return envoys, peers
}

// moveAway ends s by closing its connection, so that its client reconnects
// through the Service, most likely to another relay. grpc-go can send GOAWAY
// only to every connection at once (GracefulStop) or by age
// (MaxConnectionAge), so the relay closes the one connection; an xDS client
// treats both alike: the stream fails with UNAVAILABLE, it reconnects with
// backoff, and keeps its config meanwhile.
//
// A SotW Envoy says, wherever it lands, only the versions it holds: they
// are handed over first (handOver), since the relay it lands on may not
// know them, and this one may be gone or out of the ring by then.
func (r *Relay) moveAway(s *stream, why string) bool {
	r.handOver(r.ctx, s)
	c := r.tracker.take(s.peer)
	if c == nil {
		return false
	}
	// Counted before the close: whoever sees the client go (the client
	// itself, a test) finds it counted.
	r.metrics.Shed.WithLabelValues(why).Inc()
	s.log.Debug("moved client away", "why", why)
	c.Close()
	return true
}

// balance sheds Envoy streams above the relay's fair share, at most
// ShedRate a second, at jittered intervals, until Stop.
//
// A moved client lands on a random relay (the Service picks), old or new.
// While some relay is more than a margin m below the share (a new one),
// every relay sheds down to the share itself; once none is, relays shed
// only above share+m. So the tier settles with every relay within m of the
// share, and does not trade streams over rounding, gossip delay and the
// Service's random placement, whose spread is about √share: m is √share or
// a twenty-fifth of the share, whichever is larger (share 30: 6, 750: 30).
func (r *Relay) balance(ctx context.Context) {
	for {
		// Jittered: relays that learn of a new member together do not shed
		// in lockstep.
		d := r.cfg.Tier.BalanceInterval/2 + randN(r.rand, r.cfg.Tier.BalanceInterval/2+1)
		if !sleepCtx(ctx, d) {
			return
		}
		streams, _ := r.streams()
		share, least, ok := r.cfg.Tier.Balancer.FairShare(len(streams))
		if !ok || r.srv.draining.Load() {
			continue
		}
		m := max(int(math.Ceil(math.Sqrt(float64(share)))), share/25, 2)
		limit := share + m
		if least < share-m {
			limit = share
		}
		excess := len(streams) - limit
		if excess <= 0 {
			continue
		}
		n := min(excess, max(1, int(r.cfg.Tier.ShedRate*d.Seconds())))
		// Streams younger than three rounds stay: a client that just
		// arrived (moved here, or still syncing in a ramp) is not moved
		// again before the tier's counts have caught up with it.
		minAge := 3 * r.cfg.Tier.BalanceInterval
		// At random: picking the newest would move the same client again
		// and again (a moved client is the newest where it lands). Only
		// settled streams (everything sent was answered): a client moved
		// while an update is in flight would hold it without having ACKed
		// it, and would be counted a straggler until the next change.
		shuffle(r.rand, len(streams), func(i, j int) { streams[i], streams[j] = streams[j], streams[i] })
		moved := 0
		for _, s := range streams {
			if moved == n {
				break
			}
			if time.Since(s.opened) >= minAge && s.settled() && r.moveAway(s, "rebalance") {
				moved++
			}
		}
		r.log.Info("rebalancing Envoy streams", "streams", len(streams), "fair_share", share, "moved", moved)
	}
}

// MarkNotReady makes the relay refuse new streams (Unavailable) and fail
// /readyz, the first step of a graceful shutdown; streams already open go
// on until DrainStreams or Stop.
func (r *Relay) MarkNotReady() {
	if !r.srv.draining.Swap(true) {
		r.log.Info("relay not ready: draining")
	}
}

// DrainStreams moves every stream's client away, spread evenly over period
// so that they do not all reconnect at once: Envoys first, relays that
// subscribe to this one last (by then the ring has told them of their new
// owners). It marks the relay not ready first, and returns when every
// stream was moved or ctx ended.
func (r *Relay) DrainStreams(ctx context.Context, period time.Duration) {
	r.MarkNotReady()
	envoys, peers := r.streams()
	all := append(envoys, peers...)
	if len(all) == 0 {
		return
	}
	r.log.Info("draining streams", "envoys", len(envoys), "peers", len(peers), "period", period)
	step := period / time.Duration(len(all))
	for i, s := range all {
		if i > 0 && step > 0 && !sleepCtx(ctx, step) {
			return
		}
		r.moveAway(s, "drain")
	}
}

// refreshCredentials keeps, in forward mode, a supply of tokens istiod
// will still take: a stream keeps the token it opened with, and istiod
// refuses an expired one when a key's upstream stream must be opened again
// (after a failure, or a re-home). So an Envoy whose token comes within
// half of TokenRefreshBefore of its expiry is moved away (its connection
// closed, as balancing does): it reconnects, most likely elsewhere, with
// the token istio-agent holds now. The key's stream, if it presented that
// Envoy, has already moved to a member whose token lives longer. At most
// ShedRate a second, and a stream only once it has been open half of
// TokenRefreshBefore: one that came back with the same old token (kubelet
// had not rotated it yet) is not sent round again at once. istiod itself
// closes every connection after 30 minutes (its MaxServerConnectionAge),
// far more often than this.
func (r *Relay) refreshCredentials(ctx context.Context) {
	period := max(r.cfg.Upstream.TokenRefreshBefore/5, 100*time.Millisecond)
	every(ctx, period, func() {
		budget := max(1, int(r.cfg.Tier.ShedRate*period.Seconds()))
		horizon := time.Now().Add(r.cfg.Upstream.TokenRefreshBefore / 2)
		streams, _ := r.streams()
		for _, s := range streams {
			if budget == 0 {
				break
			}
			if s.cred != nil && !s.cred.usableAt(horizon) && time.Since(s.opened) >= r.cfg.Upstream.TokenRefreshBefore/2 && r.moveAway(s, "token_expiry") {
				budget--
			}
		}
	})
}
