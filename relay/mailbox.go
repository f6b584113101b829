package relay

import "sync"

// mailbox is a queue between two goroutines where the writer never blocks:
// put appends and signals, the reader takes everything queued at once. A
// SotW stream reads its client's requests into one, so that a handler
// blocked writing to its client never stops the reading of that same
// client: with blocking hand-offs a relay and a peer that each wait for
// the other to read deadlock (each side's flow-control window full,
// neither reading). The streams the relay opens queue their requests the
// same way, in relay/adsclient.
//
// It is bounded: put reports false once limit items, or more than
// limitBytes (as sizeOf counts them), wait, and the caller ends the stream,
// since a peer that sends that much without reading is broken or hostile.
// One item is always accepted into an empty mailbox (gRPC's message size
// limit bounds it).
type mailbox[T any] struct {
	mu         sync.Mutex
	items      []T
	bytes      int
	limit      int
	limitBytes int
	sizeOf     func(T) int   // nil: items are not counted in bytes
	ready      chan struct{} // has a value while items is not empty
	closed     bool          // close was called: put takes nothing
}

func newMailbox[T any](limit, limitBytes int, sizeOf func(T) int) *mailbox[T] {
	return &mailbox[T]{limit: limit, limitBytes: limitBytes, sizeOf: sizeOf, ready: make(chan struct{}, 1)}
}

// put queues v; it reports false, queueing nothing, when the mailbox is
// full or closed.
func (m *mailbox[T]) put(v T) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return false
	}
	size := 0
	if m.sizeOf != nil {
		size = m.sizeOf(v)
	}
	if len(m.items) > 0 && (len(m.items) >= m.limit || m.bytes+size > m.limitBytes) {
		return false
	}
	m.items = append(m.items, v)
	m.bytes += size
	wake(m.ready)
	return true
}

// close makes every later put fail: what is queued is the reader's last
// take.
func (m *mailbox[T]) close() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed = true
}

// isClosed reports whether close was called.
func (m *mailbox[T]) isClosed() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.closed
}

// take returns everything queued, oldest first, and empties the mailbox.
func (m *mailbox[T]) take() []T {
	m.mu.Lock()
	defer m.mu.Unlock()
	items := m.items
	m.items, m.bytes = nil, 0
	return items
}
