package loadtest

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/scenario"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/snapshot"
)

// TestRollUnderChurnProcesses runs the upgrade scenario that
// loadtest/scenario's TestRollUnderChurnInProcess runs in process, on
// three `meshrelay serve` processes behind a Service: the scenario is
// written once against cluster.Cluster and drives both.
func TestRollUnderChurnProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the meshrelay binary")
	}
	requireLinux(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	dir := t.TempDir()
	bin, err := BuildMeshrelay(ctx, dir, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	sc := upstream.Scenario{Services: 30, Endpoints: 60, Namespaces: 3, LocalFraction: 0.25}
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario = sc
	up, err := upstream.Start(ctx, ucfg)
	if err != nil {
		t.Fatal(err)
	}
	defer up.Stop(context.Background())

	// Snapshots in etcd, as a tier is run (TestRollUnderChurnInProcess
	// says why).
	etcd, err := snapshot.StartEmbedded(ctx, snapshot.EmbeddedConfig{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer etcd.Close()

	logs := make([]io.Writer, 3)
	for i := range logs {
		f, err := os.Create(filepath.Join(dir, fmt.Sprintf("relay-%d.log", i)))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		logs[i] = f
	}
	exited := make(chan int, 3)
	procs, err := StartRelayProcs(ctx, RelayProcsConfig{
		Meshrelay: bin, Relays: 3, Dir: dir,
		// Addresses of their own in 127/8, apart from the chaos suite's.
		Host:     func(i int) string { return fmt.Sprintf("127.0.1.%d", 10+i) },
		Upstream: up.Addr(), UpstreamProtocol: relay.ProtocolDelta, Etcd: etcd.Endpoints(),
		Log:    func(i int) io.Writer { return logs[i] },
		Exited: func(i int) { exited <- i },
	})
	if err != nil {
		t.Fatal(err)
	}
	defer procs.Stop(context.Background())
	defer func() {
		if t.Failed() {
			for i := range logs {
				b, _ := os.ReadFile(filepath.Join(dir, fmt.Sprintf("relay-%d.log", i)))
				t.Logf("relay-%d's log (last 4 KiB):\n%s", i, tail(b, 4<<10))
			}
		}
	}()
	fleet := traffic.FleetConfig{Scenario: sc, Envoys: 24, Keys: 6, Protocol: envoy.SotW}
	if err := scenario.RollUnderChurn(ctx, procs, up, fleet, 10, 2*time.Minute); err != nil {
		t.Fatal(err)
	}
	select {
	case i := <-exited:
		t.Fatalf("relay-%d exited on its own", i)
	default:
	}
}

// tail returns the last n bytes of b.
func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}
