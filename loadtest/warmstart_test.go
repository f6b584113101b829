package loadtest

import (
	"bytes"
	"io"
	"strings"
	"testing"
	"time"
)

// TestWarmStart runs the benchmark at a tiny scale and checks what must
// hold whatever the machine's speed: the warm start serves every key with
// the upstream down (it cannot have come from anywhere but etcd), etcd
// holds the snapshots, and each endpoint change was written. It asserts no
// time.
func TestWarmStart(t *testing.T) {
	requireLinux(t)
	cfg := DefaultWarmStartConfig()
	cfg.Scenario.Services, cfg.Scenario.Endpoints, cfg.Scenario.Namespaces = 40, 40, 4
	cfg.Keys, cfg.EnvoysPerConn, cfg.Changes = 8, 4, 3
	cfg.Quiet, cfg.SyncTimeout = 1500*time.Millisecond, time.Minute
	cfg.EtcdDir = t.TempDir()
	cfg.StartRelay = testStartRelay(t)
	cfg.RelayMemoryLimit = 4 << 30 // as in a 4 GiB container: GOMEMLIMIT 3.6 GiB
	var out bytes.Buffer
	rep, err := RunWarmStart(t.Context(), cfg, &out)
	if err != nil {
		t.Fatalf("RunWarmStart: %v\n%s", err, out.String())
	}
	if rep.Warm.ServedS <= 0 || rep.Cold.ServedS <= 0 {
		t.Errorf("served times cold %v, warm %v: want both measured", rep.Cold.ServedS, rep.Warm.ServedS)
	}
	if rep.StoredKeys == 0 || rep.StoredBytes == 0 {
		t.Errorf("etcd holds %d keys, %d bytes after the cold start: want the snapshots", rep.StoredKeys, rep.StoredBytes)
	}
	if len(rep.ChangeBytes) != cfg.Changes {
		t.Fatalf("measured %d changes, want %d", len(rep.ChangeBytes), cfg.Changes)
	}
	for i, b := range rep.ChangeBytes {
		if b <= 0 || rep.ChangeKeys[i] <= 0 {
			t.Errorf("change %d: %d bytes written for %d keys, want both positive", i, b, rep.ChangeKeys[i])
		}
	}
	if rep.Warm.PeakRSS == 0 {
		t.Error("the warm relay's RSS was not measured")
	}
	var table bytes.Buffer
	PrintWarmStart(&table, rep)
	if rep.RelayMemoryLimit != 4<<30 || !strings.Contains(table.String(), "relay peak RSS (as in a 4.00 GiB container)") ||
		!strings.Contains(table.String(), "relay peak RSS ≤ 1.50 GiB, cold") {
		t.Errorf("the report does not say the relay's memory limit and the RSS target:\n%s", table.String())
	}
}

// TestWarmStartKillsAHungRelay runs a warm start whose relay child, hung,
// ignores SIGTERM: RunWarmStart kills it once the stop's time is up, and
// waits for it, rather than waiting for ever.
func TestWarmStartKillsAHungRelay(t *testing.T) {
	requireLinux(t)
	noChildLeft(t)
	shortStopTimeout(t)
	cfg := DefaultWarmStartConfig()
	cfg.Scenario.Services, cfg.Scenario.Endpoints, cfg.Scenario.Namespaces = 10, 10, 2
	cfg.Keys, cfg.WarmOnly, cfg.EtcdDir = 2, true, t.TempDir()
	cfg.StartRelay = startHungChild
	returnsWithin(t, time.Minute, "RunWarmStart", func() {
		if _, err := RunWarmStart(t.Context(), cfg, io.Discard); err == nil {
			t.Error("RunWarmStart = nil error, want the killed relay's")
		}
	})
}
