package sim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// pair dials b's port 1 from a and returns both ends.
func pair(t *testing.T, a, b *Host) (client, server net.Conn) {
	t.Helper()
	l, err := b.Listen(1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	c, err := a.DialContext(context.Background(), b.Addr(1))
	if err != nil {
		t.Fatal(err)
	}
	s, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	return c, s
}

// reader reads c until it fails, recording what arrived and when.
type reader struct {
	mu   sync.Mutex
	got  []byte
	at   []time.Duration
	err  error
	done chan struct{}
}

func read(c net.Conn, start time.Time) *reader {
	r := &reader{done: make(chan struct{})}
	go func() {
		defer close(r.done)
		buf := make([]byte, 64)
		for {
			n, err := c.Read(buf)
			r.mu.Lock()
			r.got = append(r.got, buf[:n]...)
			if n > 0 {
				r.at = append(r.at, time.Since(start))
			}
			r.err = err
			r.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	return r
}

func (r *reader) bytes() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return string(r.got)
}

// TestNetworkOrderAndLatency: what one end writes arrives in order and
// after a latency; writes at the same instant arrive as one flight.
func TestNetworkOrderAndLatency(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := NewNetwork(NetworkConfig{Seed: 1, Latency: func(*rand.Rand) time.Duration { return time.Millisecond }})
		defer n.Close()
		c, s := pair(t, n.AddHost("a", "10.0.0.1"), n.AddHost("b", "10.0.0.2"))
		start := time.Now()
		r := read(s, start)
		c.Write([]byte("ab"))
		c.Write([]byte("cd")) // same instant: the same flight
		time.Sleep(5 * time.Millisecond)
		c.Write([]byte("ef"))
		time.Sleep(5 * time.Millisecond)
		if got := r.bytes(); got != "abcdef" {
			t.Fatalf("read %q, want abcdef", got)
		}
		r.mu.Lock()
		at := slices.Clone(r.at)
		r.mu.Unlock()
		if want := []time.Duration{time.Millisecond, 6 * time.Millisecond}; !slices.Equal(at, want) {
			t.Fatalf("flights arrived at %v, want %v", at, want)
		}
		c.Close()
		<-r.done
		if !errors.Is(r.err, io.EOF) {
			t.Fatalf("after the peer closed: %v, want EOF", r.err)
		}
	})
}

// TestNetworkPartition: across a cut, segments wait and arrive when it
// heals, dials wait for the heal or their deadline, datagrams are lost.
func TestNetworkPartition(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := NewNetwork(NetworkConfig{Seed: 1})
		defer n.Close()
		a, b := n.AddHost("a", "10.0.0.1"), n.AddHost("b", "10.0.0.2")
		c, s := pair(t, a, b)
		r := read(s, time.Now())
		n.Partition("a", "b")
		c.Write([]byte("held"))
		time.Sleep(time.Second)
		if got := r.bytes(); got != "" {
			t.Fatalf("read %q across the cut", got)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		_, err := a.DialContext(ctx, b.Addr(1))
		cancel()
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("dial across the cut: %v, want a timeout", err)
		}
		n.Heal()
		time.Sleep(10 * time.Millisecond)
		if got := r.bytes(); got != "held" {
			t.Fatalf("after the heal read %q, want held", got)
		}
		c.Close()
		<-r.done
	})
}

// TestNetworkFreeze: a frozen host's writes block and what is sent to it
// waits; both go on, in order, when it thaws; a dial to it is accepted
// only then.
func TestNetworkFreeze(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := NewNetwork(NetworkConfig{Seed: 1})
		defer n.Close()
		a, b := n.AddHost("a", "10.0.0.1"), n.AddHost("b", "10.0.0.2")
		c, s := pair(t, a, b)
		rs, rc := read(s, time.Now()), read(c, time.Now())
		n.Freeze("b")
		c.Write([]byte("to-b"))
		wrote := make(chan struct{})
		go func() {
			s.Write([]byte("from-b"))
			close(wrote)
		}()
		l2, err := b.Listen(2)
		if err != nil {
			t.Fatal(err)
		}
		accepted := make(chan net.Conn, 1)
		go func() {
			c2, err := l2.Accept()
			if err == nil {
				accepted <- c2
			}
		}()
		c2, err := a.DialContext(context.Background(), b.Addr(2))
		if err != nil {
			t.Fatalf("dial to a frozen host: %v (the kernel accepts it)", err)
		}
		time.Sleep(10 * time.Second)
		select {
		case <-wrote:
			t.Fatal("a frozen host's write returned")
		case <-accepted:
			t.Fatal("a frozen host accepted a connection")
		default:
		}
		if got := rs.bytes() + rc.bytes(); got != "" {
			t.Fatalf("%q went through a freeze", got)
		}
		n.Thaw("b")
		time.Sleep(10 * time.Millisecond)
		<-wrote
		(<-accepted).Close()
		if rs.bytes() != "to-b" || rc.bytes() != "from-b" {
			t.Fatalf("after the thaw: b read %q, a read %q", rs.bytes(), rc.bytes())
		}
		c.Close()
		s.Close()
		c2.Close()
		l2.Close()
		<-rs.done
		<-rc.done
	})
}

// TestNetworkCrash: a crash resets both ends of the host's connections and
// refuses dials until the host restarts.
func TestNetworkCrash(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := NewNetwork(NetworkConfig{Seed: 1})
		defer n.Close()
		a, b := n.AddHost("a", "10.0.0.1"), n.AddHost("b", "10.0.0.2")
		c, s := pair(t, a, b)
		r := read(c, time.Now())
		n.Crash("b")
		<-r.done
		if r.err == nil || errors.Is(r.err, io.EOF) {
			t.Fatalf("the crashed host's peer read %v, want a reset", r.err)
		}
		if _, err := s.Write([]byte("x")); err == nil {
			t.Fatal("a crashed host wrote")
		}
		if _, err := a.DialContext(context.Background(), b.Addr(1)); err == nil {
			t.Fatal("dialled a crashed host")
		}
		n.Restart("b")
		l, err := b.Listen(1)
		if err != nil {
			t.Fatalf("listen after restart: %v", err)
		}
		l.Close()
	})
}

// TestNetworkServiceAndDeadline: a Service connects to one of its ready
// backends; a read deadline ends a read that waits.
func TestNetworkServiceAndDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := NewNetwork(NetworkConfig{Seed: 1})
		defer n.Close()
		a, b := n.AddHost("a", "10.0.0.1"), n.AddHost("b", "10.0.0.2")
		l, err := b.Listen(1)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		n.AddService("10.0.0.9:1", func() []string { return []string{b.Addr(1)} })
		c, err := a.DialContext(context.Background(), "10.0.0.9:1")
		if err != nil {
			t.Fatal(err)
		}
		s, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(time.Second))
		start := time.Now()
		if _, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) || time.Since(start) != time.Second {
			t.Fatalf("read = %v after %v, want a deadline after 1s", err, time.Since(start))
		}
		n.AddService("10.0.0.9:2", func() []string { return nil })
		if _, err := a.DialContext(context.Background(), "10.0.0.9:2"); err == nil {
			t.Fatal("dialled a Service without endpoints")
		}
		c.Close()
		s.Close()
	})
}

// TestNetworkSeedOrders: the same seed delivers the same interleaving of
// segments over several connections; another seed, another.
func TestNetworkSeedOrders(t *testing.T) {
	order := func(seed uint64) []string {
		var out []string
		synctest.Test(t, func(t *testing.T) {
			n := NewNetwork(NetworkConfig{Seed: seed})
			defer n.Close()
			b := n.AddHost("b", "10.0.0.100")
			l, err := b.Listen(1)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			var mu sync.Mutex
			var wg sync.WaitGroup
			var clients, servers []net.Conn
			for i := range 4 {
				h := n.AddHost(fmt.Sprintf("a%d", i), fmt.Sprintf("10.0.0.%d", i+1))
				c, err := h.DialContext(context.Background(), b.Addr(1))
				if err != nil {
					t.Fatal(err)
				}
				s, err := l.Accept()
				if err != nil {
					t.Fatal(err)
				}
				clients, servers = append(clients, c), append(servers, s)
			}
			for i := range 4 {
				c, s := clients[i], servers[i]
				wg.Go(func() {
					buf := make([]byte, 1)
					for range 5 {
						if _, err := io.ReadFull(s, buf); err != nil {
							return
						}
						mu.Lock()
						out = append(out, fmt.Sprintf("%d%c", i, buf[0]))
						mu.Unlock()
					}
					s.Close()
				})
				wg.Go(func() {
					for k := range 5 {
						c.Write([]byte{byte('a' + k)})
						time.Sleep(time.Microsecond)
					}
				})
				defer c.Close()
			}
			wg.Wait()
		})
		return out
	}
	a, b, c := order(1), order(1), order(2)
	if !slices.Equal(a, b) {
		t.Fatalf("seed 1 delivered %v, then %v", a, b)
	}
	if slices.Equal(a, c) {
		t.Fatalf("seeds 1 and 2 delivered alike: %v", a)
	}
	for i := range 4 {
		var mine []string
		for _, s := range a {
			if s[0] == byte('0'+i) {
				mine = append(mine, s)
			}
		}
		want := []string{fmt.Sprintf("%da", i), fmt.Sprintf("%db", i), fmt.Sprintf("%dc", i), fmt.Sprintf("%dd", i), fmt.Sprintf("%de", i)}
		if !slices.Equal(mine, want) {
			t.Fatalf("connection %d delivered %v, want %v in order", i, mine, want)
		}
	}
}
