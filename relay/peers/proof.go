package peers

import (
	"container/heap"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// A proof (MDAuth) shows that a relay-to-relay call comes from a holder of
// the tier's peer secret, where no certificate does (a tier without mTLS
// between relays: development). It is
//
//	2.<unix milliseconds>.<nonce: 32 hex digits>.<HMAC-SHA256: 64 hex digits>
//
// the HMAC, keyed by the secret, of the calling relay's ID, the gRPC
// method, the key it subscribes for (MDKey; empty for a call), the time
// and the nonce. So a proof read off the wire is good for that call alone:
// another method or key fails the HMAC, the same one again is refused by
// the receiver's ReplayCache, and a later one falls outside the Window.
// (Version 1 was the HMAC of the ID alone, good forever; a relay of this
// version refuses it, and a relay of version 1 refuses this: in a tier
// without mTLS, relays of the two versions cannot subscribe to each other,
// and fall back to the upstream until all run one version.)
const proofVersion = "2"

// Window is how far from the receiver's clock a proof's time may be,
// either way: the tier's clocks must agree within it (NTP). A proof is
// remembered for as long as it could be accepted.
const Window = 2 * time.Minute

// DefaultReplayCapacity bounds the proofs a ReplayCache remembers: about
// 80 bytes each, 5 MiB at most. A tier accepting more proofs than this
// within two Windows (some 270 relay-to-relay calls a second, sustained)
// refuses the oldest proofs of the Window early (ReplayCache).
const DefaultReplayCapacity = 1 << 16

const nonceBytes = 16

var (
	// ErrMalformedProof: the proof is not of the form above.
	ErrMalformedProof = errors.New("peers: malformed proof")
	// ErrBadProof: the proof's HMAC is not that of the secret for this
	// relay, method, key, time and nonce.
	ErrBadProof = errors.New("peers: bad proof")
	// ErrStaleProof: the proof's time is outside the Window, or older
	// than the proofs a full ReplayCache still remembers.
	ErrStaleProof = errors.New("peers: proof out of its time window")
	// ErrReplayedProof: the proof was accepted before.
	ErrReplayedProof = errors.New("peers: proof replayed")
)

// Prover mints the proofs of relay ID. Safe for concurrent use.
type Prover struct {
	// Secret is the tier's peer secret. Never logged.
	Secret []byte
	// ID is the calling relay's.
	ID string
	// Now is the clock; nil: time.Now. For tests.
	Now func() time.Time
}

// Proof returns a fresh proof of a call of method (gRPC's full name,
// "/package.Service/Method") for key ("" but for a stream that subscribes
// to a key).
func (p Prover) Proof(method, key string) string {
	now := time.Now
	if p.Now != nil {
		now = p.Now
	}
	var nonce [nonceBytes]byte
	rand.Read(nonce[:]) // never fails (crypto/rand)
	return formatProof(p.Secret, p.ID, method, key, now().UnixMilli(), nonce)
}

func formatProof(secret []byte, id, method, key string, ms int64, nonce [nonceBytes]byte) string {
	mac := proofMAC(secret, id, method, key, ms, nonce)
	return proofVersion + "." + strconv.FormatInt(ms, 10) + "." + hex.EncodeToString(nonce[:]) + "." + hex.EncodeToString(mac)
}

// proofMAC is the HMAC of the fields, each length-prefixed, so that no two
// tuples of fields write the same bytes.
func proofMAC(secret []byte, id, method, key string, ms int64, nonce [nonceBytes]byte) []byte {
	m := hmac.New(sha256.New, secret)
	var b []byte
	for _, s := range []string{"meshrelay-peer-proof-" + proofVersion, id, method, key} {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	b = binary.BigEndian.AppendUint64(b, uint64(ms))
	b = append(b, nonce[:]...)
	m.Write(b)
	return m.Sum(nil)
}

// parsedProof is a proof's fields.
type parsedProof struct {
	ms    int64
	nonce [nonceBytes]byte
	mac   [sha256.Size]byte
}

// parseProof reads a proof, strictly: one spelling per proof.
func parseProof(s string) (parsedProof, error) {
	var p parsedProof
	parts := strings.Split(s, ".")
	if len(parts) != 4 || parts[0] != proofVersion {
		return p, ErrMalformedProof
	}
	ms, err := strconv.ParseInt(parts[1], 10, 64)
	if err != nil || ms < 0 || strconv.FormatInt(ms, 10) != parts[1] {
		return p, ErrMalformedProof
	}
	p.ms = ms
	if !lowerHex(parts[2], nonceBytes) || !lowerHex(parts[3], sha256.Size) {
		return p, ErrMalformedProof
	}
	hex.Decode(p.nonce[:], []byte(parts[2]))
	hex.Decode(p.mac[:], []byte(parts[3]))
	return p, nil
}

// lowerHex reports whether s is n bytes in lower-case hex.
func lowerHex(s string, n int) bool {
	if len(s) != 2*n {
		return false
	}
	for i := range len(s) {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// Verifier checks proofs against the tier's secret, and remembers those it
// accepted (Replays) so that none is accepted twice. Safe for concurrent
// use if Replays is.
type Verifier struct {
	// Secret is the tier's peer secret. Never logged.
	Secret []byte
	// Replays remembers the proofs accepted; required.
	Replays *ReplayCache
	// Window is how far from Now a proof's time may be; zero: Window.
	// For tests.
	Window time.Duration
	// Now is the clock; nil: time.Now. For tests.
	Now func() time.Time
}

// Verify returns nil if proof is a fresh proof, never seen before, of a
// call of method for key by relay id, and records it; otherwise one of
// the errors above (wrapped: errors.Is).
func (v Verifier) Verify(proof, id, method, key string) error {
	p, err := parseProof(proof)
	if err != nil {
		return err
	}
	want := proofMAC(v.Secret, id, method, key, p.ms, p.nonce)
	if !hmac.Equal(want, p.mac[:]) {
		return ErrBadProof
	}
	now := time.Now
	if v.Now != nil {
		now = v.Now
	}
	window := v.Window
	if window <= 0 {
		window = Window
	}
	return v.Replays.admit(p.nonce, p.ms, now().UnixMilli(), window.Milliseconds())
}

// ReplayCache remembers the proofs a relay accepted while they could be
// accepted again (their time within the Window of the clock), up to a
// capacity. When full, it forgets the oldest and refuses from then on
// every proof as old as it (its floor): memory stays bounded and no proof
// is accepted twice; the cost is that, past the capacity, proofs older
// than the floor are refused early (their caller retries with a new one).
// The floor also guards against a clock set back: a proof once forgotten
// is never accepted again. Safe for concurrent use.
type ReplayCache struct {
	mu       sync.Mutex
	capacity int
	seen     map[[nonceBytes]byte]struct{}
	byTime   proofHeap
	floor    int64 // unix ms: proofs at or before it are refused
}

// NewReplayCache returns a cache of up to capacity proofs (at least 1).
func NewReplayCache(capacity int) *ReplayCache {
	return &ReplayCache{capacity: max(1, capacity), seen: make(map[[nonceBytes]byte]struct{}), floor: -1}
}

// Len returns how many proofs the cache remembers.
func (c *ReplayCache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.seen)
}

// admit records the proof of nonce, of time ms, if it is new and within
// window of now (all unix ms).
func (c *ReplayCache) admit(nonce [nonceBytes]byte, ms, now, window int64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	// Forget what the window refuses anyway, and refuse it from now on
	// whatever the clock does next.
	for len(c.byTime) > 0 && c.byTime[0].ms < now-window {
		c.forgetOldest()
	}
	switch {
	case ms < now-window || ms > now+window:
		return fmt.Errorf("%w: %d ms from this relay's clock (±%d ms)", ErrStaleProof, ms-now, window)
	case ms <= c.floor:
		return fmt.Errorf("%w: older than the %d proofs this relay remembers", ErrStaleProof, len(c.seen))
	}
	if _, ok := c.seen[nonce]; ok {
		return ErrReplayedProof
	}
	c.seen[nonce] = struct{}{}
	heap.Push(&c.byTime, seenProof{ms: ms, nonce: nonce})
	// Past the capacity the oldest goes (this one, if it is): the floor
	// refuses it again.
	for len(c.seen) > c.capacity {
		c.forgetOldest()
	}
	return nil
}

// forgetOldest forgets the oldest proof and raises the floor to its time.
// Under c.mu.
func (c *ReplayCache) forgetOldest() {
	old := heap.Pop(&c.byTime).(seenProof)
	delete(c.seen, old.nonce)
	c.floor = max(c.floor, old.ms)
}

type seenProof struct {
	ms    int64
	nonce [nonceBytes]byte
}

// proofHeap orders proofs by time, oldest first (container/heap).
type proofHeap []seenProof

func (h proofHeap) Len() int           { return len(h) }
func (h proofHeap) Less(i, j int) bool { return h[i].ms < h[j].ms }
func (h proofHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *proofHeap) Push(x any)        { *h = append(*h, x.(seenProof)) }
func (h *proofHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// proverKey is the context key of a call's Prover.
type proverKey struct{}

// WithProver returns ctx whose relay-to-relay calls and streams, made on a
// Pool's connections, carry a fresh proof of p (MDAuth) each: the Pool
// signs the call's method and key (MDKey in ctx's outgoing metadata) as
// it goes out. The caller names itself (MDRelay) in the metadata.
func WithProver(ctx context.Context, p Prover) context.Context {
	return context.WithValue(ctx, proverKey{}, p)
}

// ProofOptions are the dial options that add WithProver's proofs to the
// calls of a connection (NewPool's connections have them).
func ProofOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			return invoker(withProof(ctx, method), method, req, reply, cc, opts...)
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			return streamer(withProof(ctx, method), desc, cc, method, opts...)
		}),
	}
}

// withProof adds ctx's Prover's proof of method to its metadata.
func withProof(ctx context.Context, method string) context.Context {
	p, ok := ctx.Value(proverKey{}).(Prover)
	if !ok {
		return ctx
	}
	md, _ := metadata.FromOutgoingContext(ctx)
	return metadata.AppendToOutgoingContext(ctx, MDAuth, p.Proof(method, OneValue(md, MDKey)))
}

// OneValue returns md's one value of key, or "" if it has none or several.
func OneValue(md metadata.MD, key string) string {
	if v := md.Get(key); len(v) == 1 {
		return v[0]
	}
	return ""
}
