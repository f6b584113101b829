package relay

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/meshrelay/meshrelay/relay/xds"
)

// slowFirstAnswers is an upstream's stream interceptor that holds back each
// stream's first response for a while and counts the streams open and not
// answered yet, and the most there were at once.
type slowFirstAnswers struct {
	delay time.Duration
	mu    sync.Mutex
	now   int
	most  int
}

func (f *slowFirstAnswers) intercept(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	f.mu.Lock()
	f.now++
	f.most = max(f.most, f.now)
	f.mu.Unlock()
	w := &slowFirstAnswerStream{ServerStream: ss, f: f}
	defer w.answered()
	return handler(srv, w)
}

func (f *slowFirstAnswers) max() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.most
}

type slowFirstAnswerStream struct {
	grpc.ServerStream
	f    *slowFirstAnswers
	once sync.Once
}

func (s *slowFirstAnswerStream) answered() {
	s.once.Do(func() {
		s.f.mu.Lock()
		s.f.now--
		s.f.mu.Unlock()
	})
}

func (s *slowFirstAnswerStream) SendMsg(m any) error {
	s.once.Do(func() {
		time.Sleep(s.f.delay) // the upstream computing a key's whole config
		s.f.mu.Lock()
		s.f.now--
		s.f.mu.Unlock()
	})
	return s.ServerStream.SendMsg(m)
}

// A relay opens the streams of many new keys at once, but has at most
// Upstream.Syncs of them waiting for their first answers: every key is
// served, and the upstream never computes more first answers at once. A
// SotW upstream slower to answer than the relay waits before it takes
// silence for "nothing changed" (confirmAfter) still holds its slot: it
// was told of no version, so its answer is coming.
func TestUpstreamSyncsBoundFirstAnswers(t *testing.T) {
	for _, tc := range []struct {
		syncs, keys int
		upstream    Protocol
		delay       time.Duration
	}{
		{2, 6, ProtocolDelta, 200 * time.Millisecond},
		{0, 6, ProtocolDelta, 200 * time.Millisecond},
		{1, 2, ProtocolSotW, confirmAfter + 300*time.Millisecond},
	} {
		keys := tc.keys
		t.Run(fmt.Sprint(tc.upstream, "/Upstream.Syncs=", tc.syncs), func(t *testing.T) {
			fa := &slowFirstAnswers{delay: tc.delay}
			up := newTestUpstreamWith(t, []grpc.ServerOption{grpc.ChainStreamInterceptor(fa.intercept)}, "ns1")
			seed(up, "ns1", 3)
			r := startRelay(t, up, func(c *Config) { c.Upstream.Syncs, c.Upstream.Protocol = tc.syncs, tc.upstream })
			conn := dial(t, r.Addr().String())
			var clients []*rawClient
			for i := range keys {
				c := newRawClient(t, conn, true, node("ns1", fmt.Sprint("wl", i), i))
				c.subscribe(xds.TypeCluster, "*")
				clients = append(clients, c)
			}
			for i, c := range clients {
				if got := names(c.recvDelta(xds.TypeCluster)); len(got) != 3 {
					t.Fatalf("key %d: clusters %v, want 3", i, got)
				}
			}
			if n := len(r.cache.heldKeys()); n != keys {
				t.Fatalf("keys = %d, want %d", n, keys)
			}
			most := fa.max()
			if tc.syncs > 0 && most > tc.syncs {
				t.Fatalf("the upstream had %d streams waiting for their first answer at once, want at most %d", most, tc.syncs)
			}
			if tc.syncs == 0 && most <= 2 {
				// Unbounded, the keys' streams open together (a check
				// that this test can see the difference).
				t.Fatalf("unbounded: at most %d first answers at once, want several", most)
			}
		})
	}
}
