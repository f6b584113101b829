package relay

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// TestFairAdmissionTakesTurns: one identity opens 40 streams at once
// against a bucket of one token and 10 a second; another opens one after
// them. The other is admitted by the next token but one, not after the
// 40: the tokens go round the identities that wait.
func TestFairAdmissionTakesTurns(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		f := newFairAdmission(10, 1, time.Minute)
		go f.run(ctx)
		var mu sync.Mutex
		var order []string
		admit := func(who string, i int, wg *sync.WaitGroup) {
			wg.Go(func() {
				if err := f.admit(ctx, who); err != nil {
					t.Errorf("%s %d: %v", who, i, err)
					return
				}
				mu.Lock()
				order = append(order, fmt.Sprint(who, i))
				mu.Unlock()
			})
		}
		var wg sync.WaitGroup
		for i := range 40 {
			admit("flood", i, &wg)
		}
		synctest.Wait() // the first took the token; 39 wait
		mu.Lock()
		before := len(order)
		mu.Unlock()
		admit("good", 0, &wg)
		wg.Wait()
		at := slices.Index(order, "good0")
		if before != 1 || at < 0 || at > before+1 {
			t.Fatalf("admitted in order %v: the good stream is %dth, want at most %d (one flood stream admitted before it came, one token at most)", order, at, before+1)
		}
	})
}

// TestFairAdmissionBounds: an identity may have maxWaitingPerIdentity
// streams waiting; the next is refused at once, and one that waits past
// maxWait is refused then; another identity still gets its turn.
func TestFairAdmissionBounds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		f := newFairAdmission(0.001, 1, 3*time.Second) // a token, then one in 1,000 s
		go f.run(ctx)
		if err := f.admit(ctx, "flood"); err != nil {
			t.Fatal(err)
		}
		errs := make(chan error, maxWaitingPerIdentity+1)
		for range maxWaitingPerIdentity {
			go func() { errs <- f.admit(ctx, "flood") }()
		}
		synctest.Wait()
		if err := f.admit(ctx, "flood"); err != errAdmitLater {
			t.Fatalf("stream past the identity's waiting bound: %v, want errAdmitLater at once", err)
		}
		start := time.Now()
		for range maxWaitingPerIdentity {
			if err := <-errs; err != errAdmitLater {
				t.Fatalf("waiting stream: %v, want errAdmitLater", err)
			}
		}
		if waited := time.Since(start); waited != 3*time.Second {
			t.Fatalf("refused after %v, want AdmitWait (3s)", waited)
		}
		if f.waiting() {
			t.Fatal("streams that gave up are still queued")
		}
	})
}

// TestStreamSharesByIdentity: at the bound, a newcomer's streams evict
// the newest of the identity most over its share, until each holds its
// share; past its share an identity is refused.
func TestStreamSharesByIdentity(t *testing.T) {
	r := newTestRelay(t)
	sh := newStreamShares(10)
	open := func(who string) (*stream, *stream, error) {
		s := r.newStream(context.Background(), false, portPlain)
		evicted, err := sh.join(s, who)
		return s, evicted, err
	}
	var flood []*stream
	for range 10 {
		s, evicted, err := open("flood")
		if err != nil || evicted != nil {
			t.Fatalf("flood stream under the bound: evicted %v, err %v", evicted, err)
		}
		flood = append(flood, s)
	}
	for i := range 5 {
		_, evicted, err := open("good")
		if err != nil {
			t.Fatalf("good stream %d: %v", i, err)
		}
		if want := flood[len(flood)-1-i]; evicted != want {
			t.Fatalf("good stream %d evicted %v, want the flood's newest but %d", i, evicted, i)
		}
	}
	if _, _, err := open("good"); err != errOverShare {
		t.Fatalf("good's sixth stream (share 5): %v, want errOverShare", err)
	}
	if _, _, err := open("flood"); err != errOverShare {
		t.Fatalf("flood's sixth stream (share 5): %v, want errOverShare", err)
	}
	// A third identity: share 3, taken from whoever holds the most.
	if _, evicted, err := open("third"); err != nil || evicted == nil {
		t.Fatalf("third identity's stream: evicted %v, err %v", evicted, err)
	}
	sh.leave(flood[0])
	sh.leave(flood[0]) // twice: counted once
	if sh.total != 9 || len(sh.by["flood"])+len(sh.by["good"])+len(sh.by["third"]) != 9 {
		t.Fatalf("after a stream left: total %d, by %v", sh.total, sh.by)
	}
}
