package sim

import (
	"context"
	"net"
	"runtime"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

// TestStoppedRelayIsCollected: a relay that served Envoys and was stopped is
// garbage-collected once nothing refers to it. It used to be kept: the
// cleanups that relay.Relay's interners (its name sets, its views' and
// versions' trees) register with runtime.AddCleanup captured the
// interner, then a field of the Relay, and the Relay reaches the interned
// values, so each cleanup kept its own object, and the whole Relay, alive
// (AddCleanup's documentation: if ptr is reachable from the cleanup, it is
// never collected). A relay process runs one Relay, so production was
// unaffected; a process that runs many (this simulation, ~5 MB a seed)
// grew without bound.
func TestStoppedRelayIsCollected(t *testing.T) {
	var collected atomic.Int64
	const runs = 4
	for range runs {
		synctest.Test(t, func(t *testing.T) {
			cfg := DefaultConfig()
			nw := NewNetwork(NetworkConfig{Seed: 1})
			tr := &tier{cfg: cfg, seed: 1, net: nw, log: discardLogger(), store: NewStore(), proto: "delta"}
			tr.upHost = nw.AddHost("upstream", upstreamIP)
			ucfg := upstream.DefaultConfig()
			ucfg.Scenario = cfg.Scenario
			ucfg.Listener = func() (net.Listener, error) { return tr.upHost.Listen(xdsPort) }
			up, err := upstream.New(ucfg)
			if err != nil {
				t.Fatal(err)
			}
			tr.up = up
			ctx := context.Background()
			if err := tr.startUpstream(ctx); err != nil {
				t.Fatal(err)
			}
			tr.relays = []*simRelay{{i: 0, host: nw.AddHost("relay-0", relayIP(0))}}
			if err := tr.startRelay(ctx, 0); err != nil {
				t.Fatal(err)
			}
			nw.AddService(serviceAddr, tr.readyRelays)
			time.Sleep(time.Second)
			if err := tr.startEnvoys(ctx, envoy.Delta, func(int, envoy.Event) {}); err != nil {
				t.Fatal(err)
			}
			time.Sleep(5 * time.Second)
			tr.stopEnvoys()
			runtime.AddCleanup(tr.relays[0].node.Relay(), func(*atomic.Int64) { collected.Add(1) }, &collected)
			tr.killRelay(0)
			tr.killUpstream(ctx)
			nw.Close()
			time.Sleep(time.Minute) // memberlist's stragglers (see Run)
		})
	}
	for range 10 {
		runtime.GC()
		time.Sleep(10 * time.Millisecond) // cleanups run on a goroutine of their own
	}
	if n := collected.Load(); n < runs-1 {
		t.Fatalf("%d of %d stopped relays were garbage-collected, want all but the last at least", n, runs)
	}
}
