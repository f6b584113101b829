package peers

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
)

const (
	methodA = "/meshrelay.ledger.v1.Ledger/GetSummary"
	methodB = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
)

// clock is a settable test clock.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time  { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) set(t time.Time) { c.mu.Lock(); defer c.mu.Unlock(); c.t = t }

func newVerifier(secret string, c *clock, capacity int) Verifier {
	return Verifier{Secret: []byte(secret), Replays: NewReplayCache(capacity), Now: c.now}
}

// TestProof: a proof is good once, for the relay, method and key it was
// made for, under the secret it was made with, within the window.
func TestProof(t *testing.T) {
	start := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	c := &clock{t: start}
	p := Prover{Secret: []byte("secret"), ID: "relay-a", Now: c.now}
	for _, tc := range []struct {
		name  string
		proof func() string // made at start
		at    time.Time     // verified then
		id    string
		meth  string
		key   string
		want  error
		twice error // verified a second time
	}{
		{"fresh", func() string { return p.Proof(methodB, "k") }, start, "relay-a", methodB, "k", nil, ErrReplayedProof},
		{"fresh call", func() string { return p.Proof(methodA, "") }, start, "relay-a", methodA, "", nil, ErrReplayedProof},
		{"at the window's far edge", func() string { return p.Proof(methodA, "") }, start.Add(Window), "relay-a", methodA, "", nil, ErrReplayedProof},
		{"from a clock ahead", func() string { return p.Proof(methodA, "") }, start.Add(-Window), "relay-a", methodA, "", nil, ErrReplayedProof},
		{"expired", func() string { return p.Proof(methodA, "") }, start.Add(Window + time.Millisecond), "relay-a", methodA, "", ErrStaleProof, ErrStaleProof},
		{"too far ahead", func() string { return p.Proof(methodA, "") }, start.Add(-Window - time.Millisecond), "relay-a", methodA, "", ErrStaleProof, ErrStaleProof},
		{"another relay's name", func() string { return p.Proof(methodA, "") }, start, "relay-b", methodA, "", ErrBadProof, ErrBadProof},
		{"another method", func() string { return p.Proof(methodA, "") }, start, "relay-a", methodB, "", ErrBadProof, ErrBadProof},
		{"another key", func() string { return p.Proof(methodB, "k") }, start, "relay-a", methodB, "k2", ErrBadProof, ErrBadProof},
		{"a key for a call", func() string { return p.Proof(methodA, "") }, start, "relay-a", methodA, "k", ErrBadProof, ErrBadProof},
		{"another secret", func() string { return Prover{Secret: []byte("other"), ID: "relay-a", Now: c.now}.Proof(methodA, "") }, start, "relay-a", methodA, "", ErrBadProof, ErrBadProof},
		{"fields shifted", func() string {
			return Prover{Secret: []byte("secret"), ID: "relay-", Now: c.now}.Proof("a"+methodA, "")
		}, start, "relay-a", methodA, "", ErrBadProof, ErrBadProof},
		{"version 1 (HMAC of the ID)", func() string { return strings.Repeat("ab", 32) }, start, "relay-a", methodA, "", ErrMalformedProof, ErrMalformedProof},
		{"upper-case spelling", func() string { return strings.ToUpper(p.Proof(methodA, "")) }, start, "relay-a", methodA, "", ErrMalformedProof, ErrMalformedProof},
		{"leading zero", func() string { s := p.Proof(methodA, ""); return "2.0" + s[2:] }, start, "relay-a", methodA, "", ErrMalformedProof, ErrMalformedProof},
		{"empty", func() string { return "" }, start, "relay-a", methodA, "", ErrMalformedProof, ErrMalformedProof},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c.set(start)
			proof := tc.proof()
			v := newVerifier("secret", c, 16)
			c.set(tc.at)
			if err := v.Verify(proof, tc.id, tc.meth, tc.key); !errors.Is(err, tc.want) {
				t.Fatalf("Verify = %v, want %v", err, tc.want)
			}
			if err := v.Verify(proof, tc.id, tc.meth, tc.key); !errors.Is(err, tc.twice) || err == nil {
				t.Fatalf("Verify again = %v, want %v", err, tc.twice)
			}
		})
	}
}

// TestProofsAreFresh: two proofs of the same call differ (their nonces),
// and each is good once.
func TestProofsAreFresh(t *testing.T) {
	p := Prover{Secret: []byte("s"), ID: "relay-a"}
	v := Verifier{Secret: []byte("s"), Replays: NewReplayCache(8)}
	a, b := p.Proof(methodA, ""), p.Proof(methodA, "")
	if a == b {
		t.Fatalf("two proofs of one call are both %s", a)
	}
	for _, proof := range []string{a, b} {
		if err := v.Verify(proof, "relay-a", methodA, ""); err != nil {
			t.Fatalf("Verify(a fresh proof) = %v", err)
		}
	}
	for _, proof := range []string{a, b} {
		if err := v.Verify(proof, "relay-a", methodA, ""); !errors.Is(err, ErrReplayedProof) {
			t.Fatalf("Verify(a proof again) = %v, want %v", err, ErrReplayedProof)
		}
	}
}

// TestReplayCacheForgetsSafely: a proof the cache forgot, because its time
// left the window or to make room, is refused as stale, even if the clock
// is set back.
func TestReplayCacheForgetsSafely(t *testing.T) {
	start := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	c := &clock{t: start}
	p := Prover{Secret: []byte("secret"), ID: "relay-a", Now: c.now}
	v := newVerifier("secret", c, 2)
	old := p.Proof(methodA, "")
	if err := v.Verify(old, "relay-a", methodA, ""); err != nil {
		t.Fatal(err)
	}
	// Past the window: forgotten at the next proof, refused for good.
	c.set(start.Add(Window + time.Second))
	if err := v.Verify(p.Proof(methodA, ""), "relay-a", methodA, ""); err != nil {
		t.Fatal(err)
	}
	if n := v.Replays.Len(); n != 1 {
		t.Errorf("the cache holds %d proofs after the first left the window, want 1", n)
	}
	c.set(start) // the clock set back
	if err := v.Verify(old, "relay-a", methodA, ""); !errors.Is(err, ErrStaleProof) {
		t.Fatalf("a forgotten proof, the clock set back: %v, want %v", err, ErrStaleProof)
	}
	// Full: the oldest goes to make room, and is refused from then on.
	c.set(start.Add(2 * Window))
	var made []string
	for i := range 3 {
		c.set(start.Add(2*Window + time.Duration(i)*time.Millisecond))
		made = append(made, p.Proof(methodA, ""))
		if err := v.Verify(made[i], "relay-a", methodA, ""); err != nil {
			t.Fatalf("proof %d: %v", i, err)
		}
	}
	if n := v.Replays.Len(); n != 2 {
		t.Errorf("a cache of 2 holds %d proofs", n)
	}
	for i, want := range []error{ErrStaleProof, ErrReplayedProof, ErrReplayedProof} {
		if err := v.Verify(made[i], "relay-a", methodA, ""); !errors.Is(err, want) {
			t.Errorf("proof %d again: %v, want %v", i, err, want)
		}
	}
}

// TestReplayCacheBoundedUnderFlood: a flood of valid proofs keeps the
// cache at its capacity, and no proof is accepted twice: in order (each
// proof newer than the last: every one accepted, the cache full of the
// newest), and from relays at once (proofs of a time the cache had to
// forget are refused as stale, never accepted).
func TestReplayCacheBoundedUnderFlood(t *testing.T) {
	const capacity, relays, each = 256, 8, 2000
	start := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	t.Run("in order", func(t *testing.T) {
		c := &clock{t: start}
		v := newVerifier("secret", c, capacity)
		p := Prover{Secret: []byte("secret"), ID: "relay-a", Now: c.now}
		var proofs []string
		for i := range relays * each {
			c.set(start.Add(time.Duration(i) * time.Millisecond / 10))
			proofs = append(proofs, p.Proof(methodA, ""))
			if err := v.Verify(proofs[i], "relay-a", methodA, ""); err != nil {
				t.Fatalf("fresh proof %d: %v", i, err)
			}
			if n := v.Replays.Len(); n > capacity {
				t.Fatalf("the cache holds %d proofs, capacity %d", n, capacity)
			}
		}
		if n := v.Replays.Len(); n != capacity {
			t.Errorf("after the flood the cache holds %d proofs, want %d", n, capacity)
		}
		for i, proof := range proofs {
			if err := v.Verify(proof, "relay-a", methodA, ""); err == nil {
				t.Fatalf("proof %d accepted twice", i)
			}
		}
		checkHeap(t, v.Replays, capacity)
	})
	t.Run("at once", func(t *testing.T) {
		c := &clock{t: start}
		v := newVerifier("secret", c, capacity)
		var (
			wg       sync.WaitGroup
			mu       sync.Mutex
			accepted []proofOf
		)
		for r := range relays {
			wg.Go(func() {
				id := fmt.Sprintf("relay-%d", r)
				p := Prover{Secret: []byte("secret"), ID: id, Now: c.now}
				for i := range each {
					if i%100 == 0 {
						c.set(c.now().Add(time.Millisecond)) // time goes on
					}
					proof := p.Proof(methodA, "")
					err := v.Verify(proof, id, methodA, "")
					if err != nil && !errors.Is(err, ErrStaleProof) {
						t.Errorf("a fresh proof: %v", err)
						return
					}
					if err == nil {
						mu.Lock()
						accepted = append(accepted, proofOf{proof, id})
						mu.Unlock()
					}
					if n := v.Replays.Len(); n > capacity {
						t.Errorf("the cache holds %d proofs, capacity %d", n, capacity)
						return
					}
				}
			})
		}
		wg.Wait()
		for _, p := range accepted {
			if err := v.Verify(p.proof, p.id, methodA, ""); err == nil {
				t.Fatalf("a proof was accepted twice")
			}
		}
		checkHeap(t, v.Replays, capacity)
	})
}

// checkHeap checks that the cache's heap, as its map, holds at most
// capacity proofs, in room for not many more.
func checkHeap(t *testing.T, c *ReplayCache, capacity int) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.byTime) != len(c.seen) || len(c.byTime) > capacity || cap(c.byTime) > 4*capacity {
		t.Errorf("the cache's heap holds %d proofs in room for %d, its map %d, capacity %d", len(c.byTime), cap(c.byTime), len(c.seen), capacity)
	}
}

type proofOf struct{ proof, id string }

// TestPoolSignsEachCall: a Pool's connection adds a fresh proof of the
// call's method and key to every call whose context has a Prover, and
// none to others.
func TestPoolSignsEachCall(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan metadata.MD, 4)
	srv := grpc.NewServer(grpc.UnknownServiceHandler(func(_ any, ss grpc.ServerStream) error {
		md, _ := metadata.FromIncomingContext(ss.Context())
		method, _ := grpc.Method(ss.Context())
		md = md.Copy()
		md.Set(":method-name", method)
		got <- md
		return nil
	}))
	served := make(chan struct{})
	go func() { defer close(served); srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-served })
	p := NewPool(1<<20, grpc.WithTransportCredentials(insecure.NewCredentials()))
	t.Cleanup(func() { p.Close() })
	conn, err := p.Conn(lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	signed := WithProver(metadata.AppendToOutgoingContext(ctx, MDRelay, "relay-a"), Prover{Secret: []byte("s"), ID: "relay-a"})
	v := Verifier{Secret: []byte("s"), Replays: NewReplayCache(8)}
	stream := &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}
	call := func(ctx context.Context, method string) metadata.MD {
		t.Helper()
		s, err := conn.NewStream(ctx, stream, method)
		if err != nil {
			t.Fatal(err)
		}
		s.CloseSend()
		s.RecvMsg(new(struct{})) // the status
		return <-got
	}
	first := call(signed, methodA)
	second := call(signed, methodA)
	keyed := call(metadata.AppendToOutgoingContext(signed, MDKey, "k"), methodB)
	for _, md := range []metadata.MD{first, second, keyed} {
		if err := v.Verify(OneValue(md, MDAuth), OneValue(md, MDRelay), OneValue(md, ":method-name"), OneValue(md, MDKey)); err != nil {
			t.Errorf("the proof of a call of %s: %v", OneValue(md, ":method-name"), err)
		}
	}
	if OneValue(first, MDAuth) == OneValue(second, MDAuth) {
		t.Error("two calls carried the same proof")
	}
	if md := call(ctx, methodA); len(md.Get(MDAuth)) != 0 {
		t.Errorf("a call without a Prover carried a proof: %v", md.Get(MDAuth))
	}
}
