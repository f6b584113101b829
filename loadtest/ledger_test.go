package loadtest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"testing"
	"time"
)

const ledgerChildEnv = "MESHRELAY_LEDGER_CHILD"

// TestLedgerChildProcess is the helper process of TestLedger: it runs one
// relay of the tier from the LedgerPeerConfig (JSON) it holds.
func TestLedgerChildProcess(t *testing.T) {
	runHelper(t, ledgerChildEnv, func(ctx context.Context, raw string) error {
		var cfg LedgerPeerConfig
		if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
			return err
		}
		return RunLedgerChild(ctx, cfg, os.Stdin, os.Stdout)
	})
}

// TestLedger runs the ledger benchmark at a tiny scale, with the peers in
// this process and apart, and checks what must hold whatever the machine's
// speed: every Envoy is counted once across the tier, the stragglers are
// the 2% the benchmark makes NACK or stay silent, the figures are filled in.
// It asserts no duration.
func TestLedger(t *testing.T) {
	requireLinux(t)
	for _, apart := range []bool{false, true} {
		t.Run(fmt.Sprint("apart=", apart), func(t *testing.T) {
			cfg := LedgerConfig{Relays: 3, Envoys: 300, Keys: 10, Resources: 200, Versions: 20, Queries: 5}
			if apart {
				cfg.StartPeer = func(ctx context.Context, pc LedgerPeerConfig) (*Child, error) {
					b, err := json.Marshal(pc)
					if err != nil {
						return nil, err
					}
					return StartChild(ctx, ChildConfig{
						Path: os.Args[0], Args: []string{"-test.run=^TestLedgerChildProcess$"},
						Env: []string{ledgerChildEnv + "=" + string(b)}, Stderr: os.Stderr,
					})
				}
			}
			rep, err := RunLedger(context.Background(), cfg, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			if rep.Stragglers != 6 || rep.TierEnvoys != 300 || rep.TierStragglers != 6 || rep.PeersApart != apart {
				t.Fatalf("stragglers %d on one relay, tier %d Envoys and %d stragglers, apart %v; want 6, 300, 6, %v",
					rep.Stragglers, rep.TierEnvoys, rep.TierStragglers, rep.PeersApart, apart)
			}
			if rep.LedgerBytes <= 0 || rep.HistoryVersions != cfg.Keys*(cfg.Versions+1) || rep.Tier.P50 <= 0 || rep.TierDelivery.P50 <= 0 {
				t.Fatalf("report not filled in: %+v", rep)
			}
		})
	}
}

// TestLedgerKillsAHungPeer runs the ledger benchmark with its peers apart,
// each a hung child that ignores SIGTERM and its stdin's EOF: RunLedger
// kills them once the stop's time is up, and waits for them, rather than
// waiting for ever.
func TestLedgerKillsAHungPeer(t *testing.T) {
	requireLinux(t)
	noChildLeft(t)
	shortStopTimeout(t)
	cfg := LedgerConfig{Relays: 2, Envoys: 100, Keys: 2, Resources: 10, Versions: 2, Queries: 1}
	cfg.StartPeer = func(ctx context.Context, _ LedgerPeerConfig) (*Child, error) {
		return startHungChild(ctx, RelayChildConfig{})
	}
	returnsWithin(t, time.Minute, "RunLedger", func() {
		_, err := RunLedger(t.Context(), cfg, io.Discard)
		t.Logf("RunLedger: %v", err)
	})
}
