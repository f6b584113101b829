// Package admission decides whether a new downstream stream may start and
// what it may cost, fairly by identity: the admission rate shared round
// robin (Fair), the streams a relay serves shared by identity (Shares),
// the verifications failing credentials may cost (FailureGate), and the
// bytes of large requests decoded at once (Budget). It knows nothing of
// xDS: an identity is a string, a stream any comparable value.
package admission

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Fair admits new Envoy streams at XDS.AdmitRate and shares the
// rate among the identities that wait for it: a stream that finds the
// bucket empty, or others waiting, queues behind its own identity's
// earlier streams, and each token goes to the next identity in turn
// (round robin). So a workload that opens streams as fast as it can
// delays its own, and a good client waits for at most one token per
// other identity waiting, not for the flood. A stream waits at most
// XDS.AdmitWait, and an identity may have MaxWaitingPerIdentity streams
// waiting; past either it is refused with ResourceExhausted and its
// client retries. Safe for concurrent use.
type Fair struct {
	lim     *rate.Limiter
	maxWait time.Duration
	wake    chan struct{}

	mu     sync.Mutex
	queues map[string][]chan struct{} // identity → its waiting streams, oldest first
	turn   []string                   // identities with streams waiting, in their turn
	// traced, if set (SetTrace), hears each stream queued and granted,
	// in order, under mu.
	traced func(event, who string)
}

// MaxWaitingPerIdentity bounds the streams one identity has waiting for
// admission: each holds a gRPC stream open.
const MaxWaitingPerIdentity = 64

func NewFair(perSecond float64, burst int, maxWait time.Duration) *Fair {
	return &Fair{
		lim:     rate.NewLimiter(rate.Limit(perSecond), burst),
		maxWait: maxWait,
		wake:    make(chan struct{}, 1),
		queues:  make(map[string][]chan struct{}),
	}
}

var ErrLater = errors.New("admission queue full or waited too long")

// Admit waits for who's turn (an identity: a SPIFFE ID, or the address
// of a client that proves none). It returns ErrLater past the
// bounds, or ctx's error.
func (f *Fair) Admit(ctx context.Context, who string) error {
	f.mu.Lock()
	if len(f.turn) == 0 && f.lim.Allow() {
		f.mu.Unlock()
		return nil
	}
	q := f.queues[who]
	if len(q) >= MaxWaitingPerIdentity {
		f.mu.Unlock()
		return ErrLater
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
	select {
	case f.wake <- struct{}{}:
	default:
	}

	t := time.NewTimer(f.maxWait)
	defer t.Stop()
	var err error
	select {
	case <-granted:
		return nil
	case <-t.C:
		err = ErrLater
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
func (f *Fair) forgetLocked(who string, granted chan struct{}) {
	q := slices.DeleteFunc(f.queues[who], func(c chan struct{}) bool { return c == granted })
	if len(q) > 0 {
		f.queues[who] = q
		return
	}
	delete(f.queues, who)
	f.turn = slices.DeleteFunc(f.turn, func(id string) bool { return id == who })
}

// Run hands out the tokens to the waiting streams, an identity at a time,
// until ctx ends.
func (f *Fair) Run(ctx context.Context) {
	for {
		select {
		case <-f.wake:
		case <-ctx.Done():
			return
		}
		for f.Waiting() {
			if f.lim.Wait(ctx) != nil {
				return
			}
			f.grantNext()
		}
	}
}

func (f *Fair) Waiting() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.turn) > 0
}

// grantNext admits the oldest waiting stream of the identity whose turn
// it is; that identity goes to the back of the turn if it has more.
func (f *Fair) grantNext() {
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

// SetTrace makes fn hear each stream queued and granted, in order (for
// tests that assert the order).
func (f *Fair) SetTrace(fn func(event, who string)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.traced = fn
}
