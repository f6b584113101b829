package loadtest

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"
)

// attackBinEnv names a meshrelay binary TestAttackSmoke runs instead of
// building one (linking takes tens of seconds).
const attackBinEnv = "LOADTEST_MESHRELAY"

// TestAttackSmoke runs every row of `loadtest attack` at tiny sizes
// against a real meshrelay serve, and checks that the report has every
// row and that its figures are sane: the good client was answered, the
// relay's RSS and CPU were read, every attack made streams and the
// refusals are the ones each attack earns. Speeds are not judged.
func TestAttackSmoke(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := t.TempDir()
	bin := os.Getenv(attackBinEnv)
	if bin == "" {
		var err error
		if bin, err = BuildMeshrelay(ctx, dir, os.Stderr); err != nil {
			t.Fatal(err)
		}
	}
	cfg := DefaultAttackConfig()
	cfg.Binaries = []AttackBinary{{Label: "this", Path: bin}}
	cfg.Dir = dir
	cfg.Scenario.Services, cfg.Scenario.Endpoints = 12, 12
	cfg.Duration = time.Second
	cfg.Flooders, cfg.LargeStreams = 2, 1
	cfg.LargeBytes, cfg.LargeEntries, cfg.MillionNames = 256<<10, 1000, 1000
	cfg.Handshakes, cfg.HandshakeConcurrency = 10, 2
	var out bytes.Buffer
	rep, err := RunAttack(ctx, cfg, &out)
	if err != nil {
		t.Fatalf("RunAttack = %v; output:\n%s", err, out.String())
	}
	if len(rep.Runs) != 1 || len(rep.Runs[0].Rows) != len(AttackNames) {
		t.Fatalf("report has %d runs (want 1) of rows %+v, want one per attack %q", len(rep.Runs), rep.Runs, AttackNames)
	}
	for i, row := range rep.Runs[0].Rows {
		if row.Name != AttackNames[i] {
			t.Errorf("row %d is %q, want %q", i, row.Name, AttackNames[i])
		}
		if row.Err != "" || row.Died != "" || row.Stopped {
			t.Errorf("%s: error %q, died %q, stopped %v, want none", row.Name, row.Err, row.Died, row.Stopped)
		}
		if row.RelayPeakRSS < 1<<20 || row.RelayPeakRSS > 8<<30 || row.RelayCPUS < 0 {
			t.Errorf("%s: relay peak RSS %d bytes, CPU %v s: not a relay's", row.Name, row.RelayPeakRSS, row.RelayCPUS)
		}
		if row.Name == AttackHandshakes {
			if h := row.Handshakes; h == nil || h.Admitted != cfg.Handshakes || h.Latency.N != cfg.Handshakes {
				t.Errorf("handshakes: %+v, want all %d admitted and timed", h, cfg.Handshakes)
			}
			continue
		}
		// The good client's attempts are paced, so it made some; none of
		// them may be refused at these sizes.
		if row.GoodAttempts == 0 || row.Good.N != row.GoodAttempts || row.Good.P50 <= 0 || row.Good.P99 < row.Good.P50 || row.Good.Max < row.Good.P99 {
			t.Errorf("%s: good client %d attempts, %+v, failed %v: want every one answered, P50 ≤ P99 ≤ max", row.Name, row.GoodAttempts, row.Good, row.GoodFailed)
		}
		want := map[string]string{ // what each attack's streams earn ("": answered)
			AttackValidFlood: "", AttackNoTokenFlood: "Unauthenticated", AttackSNAT: "Unauthenticated",
			AttackLarge: "", AttackMillionNames: "",
		}
		code, ok := want[row.Name]
		if !ok {
			if row.Attempts != 0 {
				t.Errorf("%s: %d attack streams, want none", row.Name, row.Attempts)
			}
			continue
		}
		if row.Attempts == 0 {
			t.Errorf("%s: no attack stream", row.Name)
		}
		if code == "" && row.Answered == 0 || code != "" && row.Refused[code] == 0 {
			t.Errorf("%s: %d of %d attack streams answered, refused %v; want some %s", row.Name, row.Answered, row.Attempts, row.Refused, map[bool]string{true: "answered", false: code}[code == ""])
		}
	}
	var table bytes.Buffer
	rep.WriteTable(&table)
	for _, name := range AttackNames {
		if !strings.Contains(table.String(), "| "+name+" |") {
			t.Errorf("table has no row %q:\n%s", name, table.String())
		}
	}
}
