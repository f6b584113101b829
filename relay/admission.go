package relay

// Admission and readiness: whether a new downstream stream may start, and
// whether the relay has config to serve.

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/auth"
)

// caller is what a new stream proved about who opened it: another relay
// of the tier, or, on the TLS port, a workload identity.
type caller struct {
	relay    *peerIdentity
	identity *auth.Identity
	cred     *credential // kept to present upstream (ForwardCredentials)
	share    string      // whom its admission and its share of streams count to (admissionID); "" for a relay
}

// admit decides whether a new downstream stream may start: not while the
// relay is draining or has never reached its upstream, and, for Envoys,
// once they proved who they are (on the TLS port), at their identity's
// share of AdmitRate (fairAdmission). Authentication comes first: a
// flood of bad or missing credentials costs what the failure gate lets it
// (identity.go) and takes no one's turn.
func (r *Relay) admit(ctx context.Context, p port) (caller, error) {
	if r.draining.Load() {
		return caller{}, status.Error(codes.Unavailable, "relay is draining: reconnect to another")
	}
	pi, err := r.identifyPeer(ctx, p)
	if err != nil {
		return caller{}, err
	}
	if err := r.checkPort(p, pi != nil); err != nil {
		return caller{}, err
	}
	if !r.waitWarm(ctx) {
		return caller{}, status.Error(codes.Unavailable, "relay has no config to serve yet (upstream not reached)")
	}
	if pi != nil {
		return caller{relay: pi, cred: r.forwardable(ctx, true, nil)}, nil
	}
	id, err := r.authenticate(ctx, p)
	if err != nil {
		return caller{}, err
	}
	if r.admission != nil {
		if err := r.admission.admit(ctx, admissionID(ctx, id)); err != nil {
			if !errors.Is(err, errAdmitLater) {
				return caller{}, status.FromContextError(err).Err()
			}
			r.metrics.refused.WithLabelValues("rate").Inc()
			return caller{}, status.Errorf(codes.ResourceExhausted, "relay admits %v new streams a second, shared by identity, and this one's turn did not come: retry", r.cfg.XDS.AdmitRate)
		}
	}
	return caller{identity: id, cred: r.forwardable(ctx, false, id), share: admissionID(ctx, id)}, nil
}

// openStream starts the stream an admitted caller opened, counted, for
// an Envoy, in its identity's share of XDS.MaxStreams (streamShares); a
// stream evicted to make room ends once its version is handed over.
func (r *Relay) openStream(ctx context.Context, delta bool, p port, who caller) (*stream, error) {
	s := r.newStream(ctx, delta, p)
	s.peerRelay, s.identity, s.cred = who.relay, who.identity, who.cred
	if who.relay != nil {
		return s, nil
	}
	evicted, err := r.shares.join(s, who.share)
	if err != nil {
		r.metrics.refused.WithLabelValues("share").Inc()
		return nil, status.Errorf(codes.ResourceExhausted, "relay serves %d streams at most, and this identity holds its share of them: retry", r.cfg.XDS.MaxStreams)
	}
	if evicted != nil {
		if !r.goRun(func(ctx context.Context) {
			r.handOver(ctx, evicted)
			close(evicted.evict)
		}) {
			close(evicted.evict)
		}
	}
	return s, nil
}

// admissionID is whom a stream's admission is shared by: its proven
// identity, or, where none is proven, its address.
func admissionID(ctx context.Context, id *auth.Identity) string {
	if id != nil {
		return id.SPIFFEID()
	}
	return "address " + sourceIP(ctx).String()
}

// waitWarm waits up to WarmWait for the relay to be warm.
func (r *Relay) waitWarm(ctx context.Context) bool {
	if r.cfg.XDS.WarmWait < 0 {
		return true
	}
	select {
	case <-r.warm:
		return true
	default:
	}
	t := time.NewTimer(r.cfg.XDS.WarmWait)
	defer t.Stop()
	select {
	case <-r.warm:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	r.metrics.refused.WithLabelValues("cold").Inc()
	return false
}

// watchWarm closes r.warm once the upstream connection is first ready: from
// then on the relay has a source of config (and its cache) to serve from.
func (r *Relay) watchWarm(ctx context.Context) {
	r.upConn.Connect()
	for {
		s := r.upConn.GetState()
		if s == connectivity.Ready {
			// A relay that loads snapshots takes streams once they are
			// in place: a stream that came first would find its key cold.
			select {
			case <-r.loaded:
			case <-ctx.Done():
				return
			}
			r.markWarm("upstream reached")
			return
		}
		if s == connectivity.Idle {
			r.upConn.Connect()
		}
		if !r.upConn.WaitForStateChange(ctx, s) {
			return
		}
	}
}

// markWarm lets streams in: the relay has config to serve.
func (r *Relay) markWarm(why string) {
	r.warmOnce.Do(func() {
		close(r.warm)
		r.log.Info("relay warm: " + why)
	})
}

// Ready reports whether the relay takes new streams: warm and not draining.
func (r *Relay) Ready() bool {
	select {
	case <-r.warm:
		return !r.draining.Load()
	default:
		return false
	}
}

// fairAdmission admits new Envoy streams at XDS.AdmitRate and shares the
// rate among the identities that wait for it: a stream that finds the
// bucket empty, or others waiting, queues behind its own identity's
// earlier streams, and each token goes to the next identity in turn
// (round robin). So a workload that opens streams as fast as it can
// delays its own, and a good client waits for at most one token per
// other identity waiting, not for the flood. A stream waits at most
// XDS.AdmitWait, and an identity may have maxWaitingPerIdentity streams
// waiting; past either it is refused with ResourceExhausted and its
// client retries. Safe for concurrent use.
type fairAdmission struct {
	lim     *rate.Limiter
	maxWait time.Duration
	wake    chan struct{}

	mu     sync.Mutex
	queues map[string][]chan struct{} // identity → its waiting streams, oldest first
	turn   []string                   // identities with streams waiting, in their turn
	// traced, if set (tests), hears each stream queued and granted, in
	// order, under mu.
	traced func(event, who string)
}

// maxWaitingPerIdentity bounds the streams one identity has waiting for
// admission: each holds a gRPC stream open.
const maxWaitingPerIdentity = 64

func newFairAdmission(perSecond float64, burst int, maxWait time.Duration) *fairAdmission {
	return &fairAdmission{
		lim:     rate.NewLimiter(rate.Limit(perSecond), burst),
		maxWait: maxWait,
		wake:    make(chan struct{}, 1),
		queues:  make(map[string][]chan struct{}),
	}
}

var errAdmitLater = errors.New("admission queue full or waited too long")

// admit waits for who's turn (an identity: a SPIFFE ID, or the address
// of a client that proves none). It returns errAdmitLater past the
// bounds, or ctx's error.
func (f *fairAdmission) admit(ctx context.Context, who string) error {
	f.mu.Lock()
	if len(f.turn) == 0 && f.lim.Allow() {
		f.mu.Unlock()
		return nil
	}
	q := f.queues[who]
	if len(q) >= maxWaitingPerIdentity {
		f.mu.Unlock()
		return errAdmitLater
	}
	granted := make(chan struct{})
	if len(q) == 0 {
		f.turn = append(f.turn, who)
	}
	f.queues[who] = append(q, granted)
	if f.traced != nil {
		f.traced("queued", who)
	}
	f.mu.Unlock()
	wake(f.wake)

	t := time.NewTimer(f.maxWait)
	defer t.Stop()
	var err error
	select {
	case <-granted:
		return nil
	case <-t.C:
		err = errAdmitLater
	case <-ctx.Done():
		err = ctx.Err()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	select {
	case <-granted: // granted as it gave up: take it
		return nil
	default:
	}
	f.forgetLocked(who, granted)
	return err
}

// forgetLocked takes a waiter that gave up out of who's queue.
func (f *fairAdmission) forgetLocked(who string, granted chan struct{}) {
	q := slices.DeleteFunc(f.queues[who], func(c chan struct{}) bool { return c == granted })
	if len(q) > 0 {
		f.queues[who] = q
		return
	}
	delete(f.queues, who)
	f.turn = slices.DeleteFunc(f.turn, func(id string) bool { return id == who })
}

// run hands out the tokens to the waiting streams, an identity at a time,
// until ctx ends.
func (f *fairAdmission) run(ctx context.Context) {
	for {
		select {
		case <-f.wake:
		case <-ctx.Done():
			return
		}
		for f.waiting() {
			if f.lim.Wait(ctx) != nil {
				return
			}
			f.grantNext()
		}
	}
}

func (f *fairAdmission) waiting() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.turn) > 0
}

// grantNext admits the oldest waiting stream of the identity whose turn
// it is; that identity goes to the back of the turn if it has more.
func (f *fairAdmission) grantNext() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.turn) == 0 {
		return // they gave up while the token came: it is lost
	}
	who := f.turn[0]
	f.turn = f.turn[1:]
	q := f.queues[who]
	close(q[0])
	if f.traced != nil {
		f.traced("granted", who)
	}
	if q = q[1:]; len(q) > 0 {
		f.queues[who] = q
		f.turn = append(f.turn, who)
	} else {
		delete(f.queues, who)
	}
}

// streamShares bounds the Envoy streams a relay serves at once
// (XDS.MaxStreams) and shares them by identity: at the bound, a stream
// of an identity holding less than its share (the bound over the
// identities that hold streams) is admitted and the newest stream of the
// identity holding the most, over its share, is evicted (Unavailable: its
// client reconnects, here or to another relay); a stream of an identity
// at its share is refused. So a workload that opens streams without end
// holds at most the bound, and down to its share as others come. Peers are
// not counted. Safe for concurrent use.
type streamShares struct {
	max int

	mu    sync.Mutex
	by    map[string]map[*stream]uint64 // identity → its streams → when they joined
	of    map[*stream]string
	seq   uint64
	total int
}

func newStreamShares(max int) *streamShares {
	return &streamShares{max: max, by: make(map[string]map[*stream]uint64), of: make(map[*stream]string)}
}

var errOverShare = errors.New("identity holds its share of the relay's streams")

// join counts s as who's. At the bound it evicts a stream of the identity
// most over its share, returned for the caller to end, or refuses s with
// errOverShare.
func (sh *streamShares) join(s *stream, who string) (evicted *stream, err error) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.max > 0 && sh.total >= sh.max {
		identities := len(sh.by)
		if _, ok := sh.by[who]; !ok {
			identities++
		}
		share := max(1, sh.max/identities)
		if len(sh.by[who])+1 > share {
			return nil, errOverShare
		}
		var most string
		for id, streams := range sh.by {
			if id != who && len(streams) > len(sh.by[most]) {
				most = id
			}
		}
		if len(sh.by[most]) <= share {
			return nil, errOverShare
		}
		var newest uint64
		for st, at := range sh.by[most] {
			if at >= newest {
				evicted, newest = st, at
			}
		}
		sh.leaveLocked(evicted)
	}
	if sh.by[who] == nil {
		sh.by[who] = make(map[*stream]uint64)
	}
	sh.seq++
	sh.by[who][s] = sh.seq
	sh.of[s] = who
	sh.total++
	return evicted, nil
}

// leave forgets s (once: an evicted stream was forgotten as it was).
func (sh *streamShares) leave(s *stream) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	sh.leaveLocked(s)
}

func (sh *streamShares) leaveLocked(s *stream) {
	who, ok := sh.of[s]
	if !ok {
		return
	}
	delete(sh.of, s)
	delete(sh.by[who], s)
	if len(sh.by[who]) == 0 {
		delete(sh.by, who)
	}
	sh.total--
}
