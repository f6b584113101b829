package shard

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/shard/memnet"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// startRing starts a ring on the in-memory network, joining join.
func startRing(t *testing.T, nw *memnet.Network, name string, mod func(*Config), join ...string) (*Ring, *memnet.Transport) {
	t.Helper()
	tr := nw.NewTransport()
	cfg := DefaultConfig()
	cfg.Name = name
	cfg.XDSAddr = name + ":15010"
	cfg.Transport = tr
	cfg.Gossip = "local"
	cfg.Join = join
	cfg.RejoinInterval = 500 * time.Millisecond
	cfg.MetaInterval = 50 * time.Millisecond
	if mod != nil {
		mod(&cfg)
	}
	r, err := New(cfg)
	if err != nil {
		t.Fatalf("New(%s): %v", name, err)
	}
	if err := r.Start(context.Background()); err != nil {
		t.Fatalf("Start(%s): %v", name, err)
	}
	t.Cleanup(func() { r.Stop(context.Background()) })
	return r, tr
}

// waitMembers waits until every ring sees exactly want (by relay ID).
func waitMembers(t *testing.T, rings []*Ring, want ...string) {
	t.Helper()
	slices.Sort(want)
	deadline := time.Now().Add(20 * time.Second)
	for {
		ok := true
		var got []string
		for _, r := range rings {
			got = got[:0]
			for _, m := range r.Members() {
				got = append(got, m.XDSAddr[:len(m.XDSAddr)-len(":15010")])
			}
			if !slices.Equal(got, want) {
				ok = false
				break
			}
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("members = %v, want %v on every ring", got, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestRingsAgreeOnOwners(t *testing.T) {
	nw := memnet.NewNetwork()
	a, ta := startRing(t, nw, "a", nil)
	b, _ := startRing(t, nw, "b", nil, ta.Addr())
	c, _ := startRing(t, nw, "c", nil, ta.Addr())
	rings := []*Ring{a, b, c}
	waitMembers(t, rings, "a", "b", "c")

	owned := map[string]int{}
	for _, k := range testKeys(300) {
		addr, self := a.Owner(k)
		owned[addr]++
		selves := 0
		for _, r := range rings {
			got, s := r.Owner(k)
			if got != addr {
				t.Fatalf("Owner(%q) = %q on %s, %q on a", k, got, r.Name(), addr)
			}
			if s {
				selves++
			}
		}
		if selves != 1 {
			t.Fatalf("Owner(%q): %d rings say they own it, want 1 (a says self=%v)", k, selves, self)
		}
	}
	if len(owned) != 3 {
		t.Errorf("300 keys went to %d relays (%v), want all 3", len(owned), owned)
	}
	select {
	case <-a.Changed():
	default:
		t.Error("Changed was not signalled after members joined")
	}

	// One leaves: the others drop it, and it owns nothing in their rings.
	if err := c.Leave(context.Background()); err != nil {
		t.Fatalf("Leave: %v", err)
	}
	waitMembers(t, []*Ring{a, b}, "a", "b")
	for _, k := range testKeys(300) {
		if addr, _ := a.Owner(k); addr == "c:15010" {
			t.Fatalf("Owner(%q) = c after c left", k)
		}
		if addr, self := c.Owner(k); self {
			t.Fatalf("c still owns %q (%s) after leaving", k, addr)
		}
	}
}

func TestUniqueNamePerIncarnation(t *testing.T) {
	nw := memnet.NewNetwork()
	a, ta := startRing(t, nw, "a", nil)
	b1, _ := startRing(t, nw, "b", nil, ta.Addr())
	waitMembers(t, []*Ring{a, b1}, "a", "b")
	// b dies without leaving and comes back at once, as in a crash loop:
	// its new incarnation is a new member, not a dead one to wait out.
	b1.mu.Lock()
	b1.left = true // nobody says goodbye in a crash
	b1.mu.Unlock()
	b1.ml.Shutdown()
	b2, _ := startRing(t, nw, "b", nil, ta.Addr())
	if b1.Name() == b2.Name() {
		t.Fatalf("both incarnations are named %q", b1.Name())
	}
	waitMembers(t, []*Ring{a, b2}, "a", "b")
}

func TestConnectionCountsAreGossiped(t *testing.T) {
	nw := memnet.NewNetwork()
	a, ta := startRing(t, nw, "a", nil)
	b, _ := startRing(t, nw, "b", nil, ta.Addr())
	c, _ := startRing(t, nw, "c", nil, ta.Addr())
	waitMembers(t, []*Ring{a, b, c}, "a", "b", "c")
	if _, _, ok := (&Ring{}).FairShare(0); ok {
		t.Error("FairShare on a ring with no members: ok, want not ok")
	}
	b.FairShare(30)
	c.FairShare(0)
	deadline := time.Now().Add(10 * time.Second)
	for {
		share, least, ok := a.FairShare(90)
		if ok && share == 40 && least == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a.FairShare(90) = %d, %d, %v; want 40 ((90+30+0)/3), 0", share, least, ok)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPartitionHeals: a relay cut off for longer than memberlist takes to
// declare it dead finds the tier again through the periodic rejoin.
func TestPartitionHeals(t *testing.T) {
	nw := memnet.NewNetwork()
	a, ta := startRing(t, nw, "a", nil)
	b, tb := startRing(t, nw, "b", nil, ta.Addr())
	c, _ := startRing(t, nw, "c", nil, ta.Addr())
	waitMembers(t, []*Ring{a, b, c}, "a", "b", "c")

	nw.Partition(tb.Addr())
	waitMembers(t, []*Ring{a, c}, "a", "c")
	waitMembers(t, []*Ring{b}, "b")
	if _, self := b.Owner("any"); !self {
		t.Error("b, alone on its island, does not own every key")
	}
	nw.Heal()
	waitMembers(t, []*Ring{a, b, c}, "a", "b", "c")
}

func TestTiersWithDifferentKeysOrLabelsNeverMerge(t *testing.T) {
	key1 := []byte("0123456789abcdef")
	key2 := []byte("fedcba9876543210")
	for _, tc := range []struct {
		name   string
		a, b   func(*Config)
		merges bool
	}{
		{"same key", func(c *Config) { c.SecretKey = key1 }, func(c *Config) { c.SecretKey = key1 }, true},
		{"other key", func(c *Config) { c.SecretKey = key1 }, func(c *Config) { c.SecretKey = key2 }, false},
		{"key and none", func(c *Config) { c.SecretKey = key1 }, nil, false},
		{"other cluster", func(c *Config) { c.Cluster = "prod" }, func(c *Config) { c.Cluster = "staging" }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nw := memnet.NewNetwork()
			a, ta := startRing(t, nw, "a", tc.a)
			b, _ := startRing(t, nw, "b", tc.b, ta.Addr())
			if tc.merges {
				waitMembers(t, []*Ring{a, b}, "a", "b")
				return
			}
			time.Sleep(time.Second) // a few rejoin rounds
			waitMembers(t, []*Ring{a}, "a")
			waitMembers(t, []*Ring{b}, "b")
		})
	}
}

// TestJoinByDNS joins three rings on real UDP/TCP sockets at 127.0.0.1-3,
// one port, through a name that resolves to all three, as a headless
// Service does.
func TestJoinByDNS(t *testing.T) {
	port := freePort(t)
	resolver := fakeResolver{"relays.test": {"127.0.0.1", "127.0.0.2", "127.0.0.3"}}
	var rings []*Ring
	for i := 1; i <= 3; i++ {
		cfg := DefaultConfig()
		cfg.Name = fmt.Sprintf("r%d", i)
		cfg.XDSAddr = fmt.Sprintf("r%d:15010", i)
		cfg.BindAddr = fmt.Sprintf("127.0.0.%d", i)
		cfg.BindPort = port
		cfg.Gossip = "local"
		cfg.Join = []string{"relays.test"}
		cfg.Resolver = resolver
		cfg.RejoinInterval = 300 * time.Millisecond
		r, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Start(context.Background()); err != nil {
			t.Skipf("cannot bind gossip on 127.0.0.%d:%d: %v", i, port, err)
		}
		t.Cleanup(func() { r.Stop(context.Background()) })
		rings = append(rings, r)
	}
	waitMembers(t, rings, "r1", "r2", "r3")
}

type fakeResolver map[string][]string

func (f fakeResolver) LookupHost(_ context.Context, host string) ([]string, error) {
	if ips, ok := f[host]; ok {
		return ips, nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

// freePort returns a port free for TCP and UDP on 127.0.0.1.
func freePort(t *testing.T) int {
	t.Helper()
	for range 20 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		u, err := net.ListenPacket("udp", "127.0.0.1:"+strconv.Itoa(port))
		if err == nil {
			u.Close()
			return port
		}
	}
	t.Fatal("no free port")
	return 0
}

func TestConfigValidation(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*Config)
	}{
		{"no name", func(c *Config) { c.Name = "" }},
		{"bad xds addr", func(c *Config) { c.XDSAddr = "nowhere" }},
		{"short key", func(c *Config) { c.SecretKey = []byte("short") }},
		{"load", func(c *Config) { c.Load = 0.9 }},
		{"partitions", func(c *Config) { c.Partitions = 0 }},
		{"gossip", func(c *Config) { c.Gossip = "wan" }},
		{"rejoin", func(c *Config) { c.RejoinInterval = 0 }},
		{"cluster", func(c *Config) { c.Cluster = "" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Name, cfg.XDSAddr = "a", "a:15010"
			tc.mod(&cfg)
			if _, err := New(cfg); err == nil {
				t.Fatal("New succeeded, want an error")
			}
		})
	}
}

func TestLoadKeyFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, tc := range []struct {
		name, content string
		want          int
	}{
		{"base64", "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=\n", 32},
		{"base64 16", "MDEyMzQ1Njc4OWFiY2RlZg==", 16},
		{"raw", "0123456789abcdef0123456789abcdef", 24}, // it is base64 too: 24 bytes
		{"not base64", "0123456789abcdef!", 0},
		{"short", "abc", 0},
	} {
		k, err := LoadKeyFile(write(tc.name, tc.content))
		if tc.want == 0 {
			if err == nil {
				t.Errorf("%s: LoadKeyFile = %d bytes, want an error", tc.name, len(k))
			}
			continue
		}
		if err != nil || len(k) != tc.want {
			t.Errorf("%s: LoadKeyFile = %d bytes, %v; want %d", tc.name, len(k), err, tc.want)
		}
	}
	if _, err := LoadKeyFile(filepath.Join(dir, "missing")); err == nil {
		t.Error("LoadKeyFile of a missing file succeeded")
	}
}
