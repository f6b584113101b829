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
