package shard_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/anypb"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/loadtest"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
)

const (
	cdsType = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
	edsType = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
)

// TestLedgerQueries: a 3-relay tier, 12 Envoys over 3 keys. In every key,
// two Envoys take everything, one NACKs endpoint updates once told to, and
// one never ACKs. After an endpoint moves, every tier-wide answer, asked of
// any relay, is exactly what those roles imply: convergence per key, per
// relay and tier-wide, the stragglers and their reasons, one NACK
// fingerprint for the three NACKing Envoys, the delivery of the moved
// endpoint's ClusterLoadAssignment, and the wait.
func TestLedgerQueries(t *testing.T) {
	ctx := context.Background()
	up, sc := startLedgerUpstream(t)
	tier, err := loadtest.StartTier(ctx, loadtest.TierConfig{Relays: 3, Upstream: up.Addr(), Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tier.Stop(context.Background()) })
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := tier.WaitConverged(wctx); err != nil {
		t.Fatal(err)
	}

	const keys, envoys = 3, 12
	role := func(i int) string { return []string{"ok", "ok", "nack", "silent"}[i/keys] }
	var rejecting atomic.Bool
	fleet, err := loadtest.StartFleet(ctx, loadtest.FleetConfig{
		Scenario: sc, Envoys: envoys, Keys: keys, Protocol: envoy.Delta, Target: tier.Addr(),
		Configure: func(i int, c *envoy.Config) {
			switch role(i) {
			case "silent":
				c.NoACK = true
			case "nack":
				c.Reject = func(typeURL string, res []*anypb.Any) error {
					if typeURL != edsType || !rejecting.Load() || len(res) == 0 {
						return nil
					}
					// The text names this Envoy's own address: the
					// fingerprint must still be one for all three.
					return fmt.Errorf("endpoint of %q rejected by %s: priority 7 invalid", res[0].GetTypeUrl(), c.Node.GetId())
				}
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fleet.Stop(context.Background()) })
	byRole := map[string][]string{}
	for i, e := range fleet.Envoys() {
		byRole[role(i)] = append(byRole[role(i)], e.ID())
	}
	anyRelay := func(i int) *loadtest.TierRelay { return tier.Running()[i%len(tier.Running())] }

	// Before the change: every Envoy but the silent ones is current.
	waitLedger(t, "initial sync", func() (bool, string) {
		tl := anyRelay(0).Node.Relay().TierLedger(ctx, ledger.Scope{})
		c := tl.Convergence()
		return c == (ledger.Convergence{Envoys: envoys, Current: 9}) && len(tl.Missing) == 0,
			fmt.Sprintf("%+v missing %v stragglers %+v silent %v", c, tl.Missing, tl.Stragglers(0), byRole["silent"])
	})

	rejecting.Store(true)
	ch, err := up.MoveEndpoint(0)
	if err != nil {
		t.Fatal(err)
	}
	// The moved endpoint's new content, as a current Envoy holds it.
	var newHash ledger.Hash
	okEnvoy := fleet.Envoys()[0]
	waitLedger(t, "the change to reach a current Envoy", func() (bool, string) {
		held, ok := okEnvoy.Resources(edsType)[ch.Name]
		if !ok {
			return false, "not held"
		}
		h, err := ledger.ParseHash(held.Version)
		if err != nil {
			return false, err.Error()
		}
		newHash = h
		return held.Generation >= ch.Generation, "older generation"
	})

	waitLedger(t, "the change to settle", func() (bool, string) {
		tl := anyRelay(1).Node.Relay().TierLedger(ctx, ledger.Scope{})
		reasons := map[string]ledger.Reason{}
		for _, s := range tl.Stragglers(0) {
			reasons[s.Node] = s.Reason
		}
		c := tl.Convergence()
		return c == (ledger.Convergence{Envoys: envoys, Current: 6}) && reasons[byRole["nack"][0]] == ledger.NACKed && len(tl.Missing) == 0,
			fmt.Sprintf("%+v %v missing %v", c, reasons, tl.Missing)
	})

	// Stragglers, with their reasons and types.
	want := map[string]string{}
	for _, n := range byRole["nack"] {
		want[n] = string(ledger.NACKed) + " " + edsType
	}
	for _, n := range byRole["silent"] {
		want[n] = string(ledger.NotACKed) + " " + cdsType
	}
	report := anyRelay(2).Node.Relay().TierLedger(ctx, ledger.Scope{})
	got := map[string]string{}
	fingerprints := map[ledger.Fingerprint]int{}
	for _, s := range report.Stragglers(0) {
		got[s.Node] = string(s.Reason) + " " + s.Type
		if s.NACK != nil {
			fingerprints[s.NACK.Fingerprint]++
		}
	}
	if !maps.Equal(got, want) {
		t.Fatalf("stragglers:\n got %v\nwant %v", got, want)
	}
	if len(fingerprints) != 1 || slices.Collect(maps.Values(fingerprints))[0] != 3 {
		t.Fatalf("NACK fingerprints = %v, want one, held by 3 Envoys", fingerprints)
	}

	// Per key and per relay.
	for key, c := range report.ByKey() {
		if c != (ledger.Convergence{Envoys: 4, Current: 2}) {
			t.Errorf("ByKey()[%s] = %+v, want 2 of 4", key, c)
		}
	}
	if n := len(report.ByKey()); n != keys {
		t.Errorf("ByKey() has %d keys, want %d", n, keys)
	}
	wantByRelay := map[string]ledger.Convergence{}
	for _, r := range tier.Running() {
		var c ledger.Convergence
		for _, cs := range r.Node.Relay().Clients() {
			if cs.PeerRelay != "" {
				continue
			}
			c.Envoys++
			if slices.Contains(byRole["ok"], cs.NodeID) {
				c.Current++
			}
		}
		if c.Envoys > 0 {
			wantByRelay[r.ID] = c
		}
	}
	if gotByRelay := report.ByRelay(); !maps.Equal(gotByRelay, wantByRelay) {
		t.Errorf("ByRelay() = %v, want %v", gotByRelay, wantByRelay)
	}

	// Delivery of the moved endpoint: the "ok" Envoys hold it.
	d, missing, err := anyRelay(0).Node.Relay().TierDelivery(ctx, ledger.Scope{}, edsType, ch.Name, newHash)
	if err != nil || len(missing) > 0 {
		t.Fatalf("TierDelivery: %v, missing %v", err, missing)
	}
	if envs, del, known := d.Counts(); envs != envoys || del != 6 || !known || d.Done() {
		t.Fatalf("TierDelivery = %d of %d delivered, known %v, done %v; want 6 of 12, known, not done", del, envs, known, d.Done())
	}
	gotMissing := map[string]ledger.Reason{}
	for _, k := range d.Keys {
		for _, s := range k.Missing {
			gotMissing[s.Node] = s.Reason
		}
	}
	wantMissing := map[string]ledger.Reason{}
	for _, n := range byRole["nack"] {
		wantMissing[n] = ledger.NACKed
	}
	for _, n := range byRole["silent"] {
		wantMissing[n] = ledger.NotACKed
	}
	if !maps.Equal(gotMissing, wantMissing) {
		t.Fatalf("TierDelivery missing = %v, want %v", gotMissing, wantMissing)
	}
	// The content before the move has reached the "ok" and "nack" Envoys:
	// the ones that ACKed any version of it.
	for _, key := range slices.Sorted(maps.Keys(report.ByKey())) {
		if c := report.ByKey()[key]; c.Envoys == 0 {
			t.Fatalf("key %s has no Envoys", key)
		}
	}

	// Wait: half the tier is current; all of it never is.
	wctx2, cancel2 := context.WithTimeout(ctx, 10*time.Second)
	defer cancel2()
	if tl, err := anyRelay(1).Node.Relay().TierWait(wctx2, ledger.Scope{}, 0.5); err != nil || tl.Convergence().Share() < 0.5 {
		t.Fatalf("TierWait(0.5) = %+v, %v", tl.Convergence(), err)
	}
	sctx, cancel3 := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel3()
	tl2, err := anyRelay(2).Node.Relay().TierWait(sctx, ledger.Scope{}, 1)
	if !errors.Is(err, context.DeadlineExceeded) || len(tl2.Stragglers(0)) != 6 {
		t.Fatalf("TierWait(1.0) = %d stragglers, %v; want 6 and the deadline", len(tl2.Stragglers(0)), err)
	}
	// One key: its Envoys only.
	key := report.Stragglers(0)[0].Key
	if c := anyRelay(0).Node.Relay().TierLedger(ctx, ledger.Scope{Key: key}).Convergence(); c != (ledger.Convergence{Envoys: 4, Current: 2}) {
		t.Fatalf("TierLedger(key %s) = %+v, want 2 of 4", key, c)
	}

	// The receipt → ACK histogram saw the ACKs.
	var observed uint64
	for _, r := range tier.Running() {
		observed += histogramCount(t, r, "meshrelay_proxy_convergence_time_seconds")
	}
	if observed == 0 {
		t.Fatal("meshrelay_proxy_convergence_time_seconds observed nothing")
	}
	for _, v := range fleet.Violations() {
		t.Errorf("protocol violation: %v", v)
	}
}

func startLedgerUpstream(t *testing.T) (*upstream.Upstream, upstream.Scenario) {
	t.Helper()
	sc := upstream.Scenario{Services: 12, Endpoints: 12, Namespaces: 3, LocalFraction: 0}
	ucfg := upstream.DefaultConfig()
	ucfg.Scenario = sc
	up, err := upstream.New(ucfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := up.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { up.Stop(context.Background()) })
	return up, sc
}

// waitLedger polls cond for up to 30 s (it is bounded: the test fails then).
func waitLedger(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	var last string
	for time.Now().Before(deadline) {
		var ok bool
		if ok, last = cond(); ok {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("waiting for %s: %s", what, last)
}

// histogramCount returns the sample count of a histogram in relay r's
// registry, over every label.
func histogramCount(t *testing.T, r *loadtest.TierRelay, name string) uint64 {
	t.Helper()
	mfs, err := r.Node.Relay().Gatherer().Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			n += m.GetHistogram().GetSampleCount()
		}
	}
	return n
}
