package admission

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
		f := NewFair(10, 1, time.Minute)
		go f.Run(ctx)
		var mu sync.Mutex
		var order []string
		admit := func(who string, i int, wg *sync.WaitGroup) {
			wg.Go(func() {
				if err := f.Admit(ctx, who); err != nil {
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

// TestFairAdmissionBounds: an identity may have MaxWaitingPerIdentity
// streams waiting; the next is refused at once, and one that waits past
// maxWait is refused then; another identity still gets its turn.
func TestFairAdmissionBounds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		f := NewFair(0.001, 1, 3*time.Second) // a token, then one in 1,000 s
		go f.Run(ctx)
		if err := f.Admit(ctx, "flood"); err != nil {
			t.Fatal(err)
		}
		errs := make(chan error, MaxWaitingPerIdentity+1)
		for range MaxWaitingPerIdentity {
			go func() { errs <- f.Admit(ctx, "flood") }()
		}
		synctest.Wait()
		if err := f.Admit(ctx, "flood"); err != ErrLater {
			t.Fatalf("stream past the identity's waiting bound: %v, want ErrLater at once", err)
		}
		start := time.Now()
		for range MaxWaitingPerIdentity {
			if err := <-errs; err != ErrLater {
				t.Fatalf("waiting stream: %v, want ErrLater", err)
			}
		}
		if waited := time.Since(start); waited != 3*time.Second {
			t.Fatalf("refused after %v, want AdmitWait (3s)", waited)
		}
		if f.Waiting() {
			t.Fatal("streams that gave up are still queued")
		}
	})
}

// TestStreamSharesByIdentity: at the bound, a newcomer's streams evict
// the newest of the identity most over its share, until each holds its
// share; past its share an identity is refused.
func TestStreamSharesByIdentity(t *testing.T) {
	sh := NewShares[int](10)
	next := 0
	open := func(who string) (s, evicted int, ok bool, err error) {
		next++
		evicted, ok, err = sh.Join(next, who)
		return next, evicted, ok, err
	}
	var flood []int
	for range 10 {
		s, _, evicted, err := open("flood")
		if err != nil || evicted {
			t.Fatalf("flood stream under the bound: evicted %v, err %v", evicted, err)
		}
		flood = append(flood, s)
	}
	for i := range 5 {
		_, evicted, ok, err := open("good")
		if err != nil || !ok {
			t.Fatalf("good stream %d: evicted nothing, err %v", i, err)
		}
		if want := flood[len(flood)-1-i]; evicted != want {
			t.Fatalf("good stream %d evicted %d, want the flood's newest but %d (%d)", i, evicted, i, want)
		}
	}
	if _, _, _, err := open("good"); err != ErrOverShare {
		t.Fatalf("good's sixth stream (share 5): %v, want ErrOverShare", err)
	}
	if _, _, _, err := open("flood"); err != ErrOverShare {
		t.Fatalf("flood's sixth stream (share 5): %v, want ErrOverShare", err)
	}
	// A third identity: share 3, taken from whoever holds the most.
	if _, _, ok, err := open("third"); err != nil || !ok {
		t.Fatalf("third identity's stream: evicted %v, err %v", ok, err)
	}
	_, before := sh.Len("flood")
	sh.Leave(flood[0])
	sh.Leave(flood[0]) // twice: counted once
	if total, of := sh.Len("flood"); total != 9 || of != before-1 {
		t.Fatalf("after a flood stream left: %d streams, %d the flood's; want 9 and %d", total, of, before-1)
	}
}
