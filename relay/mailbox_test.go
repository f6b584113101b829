package relay

import (
	"context"
	"io"
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/admission"
)

// newTestRelay builds a relay that is not started, its upstream an address
// nothing dials, with each of set applied to its config first.
func newTestRelay(tb testing.TB, set ...func(*Config)) *Relay {
	tb.Helper()
	cfg := DefaultConfig()
	cfg.Upstream.Addr = "unused:1"
	for _, f := range set {
		f(&cfg)
	}
	r, err := New(cfg)
	if err != nil {
		tb.Fatalf("New: %v", err)
	}
	return r
}

// TestServeKeepsReading: while the stream's goroutine is stuck (as when it
// is blocked writing to a client that does not read), the relay goes on
// reading that client's requests. With a blocking hand-off it would stop
// after one, and a client doing the same (blocked sending, not reading)
// would deadlock with it once both flow-control windows are full.
func TestServeKeepsReading(t *testing.T) {
	r := newTestRelay(t)
	ctx, cancel := context.WithCancel(context.Background())
	s := r.srv.newStream(ctx, false, portPlain)
	stuck := make(chan struct{})
	var read atomic.Int32
	recv := func() (int, error) {
		if n := read.Add(1); n <= 100 {
			return int(n), nil
		}
		<-ctx.Done()
		return 0, io.EOF
	}
	done := make(chan error, 1)
	go func() { done <- serve(s, recv, nil, func(int) error { <-stuck; return nil }, nil) }()
	waitFor(t, "100 requests read while the handler is stuck", func() bool { return read.Load() > 100 })
	close(stuck)
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("serve = %v, want nil after the client went away", err)
	}
}

// TestServeFloodEndsStream: a client that queues more than
// maxQueuedRequests without the relay getting to them loses its stream.
func TestServeFloodEndsStream(t *testing.T) {
	r := newTestRelay(t)
	s := r.srv.newStream(context.Background(), false, portPlain)
	stuck := make(chan struct{})
	var read atomic.Int32
	recv := func() (int, error) { read.Add(1); return 1, nil } // an endless flood
	done := make(chan error, 1)
	go func() { done <- serve(s, recv, nil, func(int) error { <-stuck; return nil }, nil) }()
	// A full mailbox (whatever the stuck handler took before), and the
	// request that did not fit ended the reading.
	waitFor(t, "the mailbox to overflow", func() bool { return read.Load() >= maxQueuedRequests+1 })
	close(stuck)
	err := <-done
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("serve = %v, want ResourceExhausted", err)
	}
}

// TestServeByteBudget: requests queued without the relay getting to them
// end the stream once they pass maxQueuedBytes, before the count limit
// would. (They are under admission.Floor: a larger one stops the reading
// until it is handled.) The handler is stuck on its first batch until the
// reader overflowed (the overflow gives its request back: release), so
// what was read is at most that batch, a mailbox full by bytes and the
// request that overflowed it: 4,097 of 32 KiB, where the count limit
// alone would let 4,098 or more through. By order, whatever the load.
func TestServeByteBudget(t *testing.T) {
	r := newTestRelay(t)
	s := r.srv.newStream(context.Background(), false, portPlain)
	const perBudget = maxQueuedBytes / (admission.Floor / 2) // requests of 32 KiB the byte bound holds
	stuck, overflowed, capped := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var read atomic.Int32
	recv := func() (int, error) {
		// A batch the handler took and a full mailbox at most, then the
		// request that overflows: more means the byte bound did not hold.
		if read.Add(1) > 2*perBudget+1 {
			close(capped)
			<-stuck
			return 0, io.EOF
		}
		return 1, nil
	}
	size := func(int) int { return admission.Floor / 2 } // every request 32 KiB
	var once sync.Once
	release := func(int) { once.Do(func() { close(overflowed) }) }
	done := make(chan error, 1)
	go func() { done <- serve(s, recv, size, func(int) error { <-stuck; return nil }, release) }()
	select {
	case <-overflowed:
	case <-capped:
		close(stuck)
		<-done
		t.Fatalf("read %d requests of 32 KiB with the handler stuck, and the %d MiB bound did not end the stream", read.Load(), maxQueuedBytes>>20)
	}
	close(stuck)
	if err := <-done; status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("serve = %v after %d requests of 32 KiB, want ResourceExhausted from the %d MiB bound", err, read.Load(), maxQueuedBytes>>20)
	}
}
