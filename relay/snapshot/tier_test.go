package snapshot_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/snapshot"
)

// persistedMatches compares what etcd holds with what the upstream serves
// now: every key of the fleet persisted, every resource of every type it
// holds equal to the upstream's. It returns a description of the first
// difference.
func persistedMatches(t *testing.T, endpoints []string, up *upstream.Upstream, keys int) (bool, string) {
	t.Helper()
	cfg := snapshot.DefaultConfig()
	cfg.Endpoints, cfg.Member = endpoints, "reader"
	s, err := snapshot.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop(context.Background())
	saved, err := s.Load(t.Context())
	if err != nil {
		return false, err.Error()
	}
	if len(saved) != keys {
		return false, fmt.Sprintf("%d keys persisted, want %d", len(saved), keys)
	}
	for _, k := range saved {
		group := aggkey.Namespace(k.Key) // the upstream serves each namespace its own
		snap := up.Snapshot(group)
		for _, st := range k.Types {
			if len(st.Resources) != len(snap[st.Type]) {
				return false, fmt.Sprintf("%s: %d of %s persisted, upstream serves %d", k.Key, len(st.Resources), st.Type, len(snap[st.Type]))
			}
			for _, r := range st.Resources {
				want, err := proto.MarshalOptions{Deterministic: true}.Marshal(snap[st.Type][r.Name])
				if err != nil {
					t.Fatal(err)
				}
				if string(want) != string(r.Body) {
					return false, fmt.Sprintf("%s: %s %s persisted differs from the upstream's", k.Key, st.Type, r.Name)
				}
			}
		}
	}
	return true, ""
}

// TestTierPersistsWhatOwnersServe runs a 3-relay tier on one etcd: the
// owners persist their keys; when an owner dies or is partitioned away, the
// keys' new owners take over the writes (a deposed owner cannot overwrite
// them); and a whole new tier started while the upstream is down serves
// every Envoy the latest config from etcd.
func TestTierPersistsWhatOwnersServe(t *testing.T) {
	ctx := context.Background()
	endpoints := startEtcd(t, "").Endpoints()
	up, sc := startUpstream(t, upstream.Scenario{Services: 30, Endpoints: 30, Namespaces: 3, LocalFraction: 0.25})
	const keys = 6
	startTier := func() *cluster.Tier { return startPersistingTier(t, up, endpoints, nil) }
	startFleet := func(tier *cluster.Tier) *traffic.Fleet { return startTierFleet(t, sc, tier, 18, keys) }
	synced := func(f *traffic.Fleet, when string) { t.Helper(); waitFleetSynced(t, f, up, when) }
	persisted := func(when string) {
		t.Helper()
		waitUntil(t, when+": etcd holds the latest config", func() (bool, string) { return persistedMatches(t, endpoints, up, keys) })
	}
	change := func(i int) {
		if _, err := up.MoveEndpoint(i); err != nil {
			t.Fatal(err)
		}
	}

	tier := startTier()
	fleet := startFleet(tier)
	synced(fleet, "initial sync")
	persisted("after the initial sync")

	// An owner dies: its keys' new owners write the next change.
	if err := tier.StopRelay(ctx, 0, false); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	if err := tier.WaitConverged(wctx); err != nil {
		t.Fatal(err)
	}
	cancel()
	change(0)
	synced(fleet, "after the owner died")
	persisted("after the owner died")

	// A relay is cut off: it believes it owns every key and claims those
	// it serves; after the heal the ring's owners claim them back, and the
	// partitioned relay's late writes are fenced off.
	tier.Partition(1)
	change(1)
	synced(fleet, "during the partition")
	tier.Heal()
	wctx, cancel = context.WithTimeout(ctx, 30*time.Second)
	if err := tier.WaitConverged(wctx); err != nil {
		t.Fatal(err)
	}
	cancel()
	change(2)
	synced(fleet, "after the heal")
	persisted("after the heal")
	for _, v := range fleet.Violations() {
		t.Errorf("protocol violation: %v", v)
	}

	// The whole tier goes, then the upstream; a new tier serves new
	// Envoys the latest config from etcd alone.
	fleet.Stop(ctx)
	tier.Stop(ctx)
	if err := up.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	tier2 := startTier()
	fleet2 := startFleet(tier2)
	synced(fleet2, "a new tier, upstream down")
	for _, v := range fleet2.Violations() {
		t.Errorf("protocol violation: %v", v)
	}
}

// startPersistingTier starts a converged 3-relay tier of up on the etcd at
// endpoints, each relay's configuration changed by adjust if set, stopped
// at the end of the test. MESHRELAY_TEST_LOG=1 prints its debug logs.
func startPersistingTier(t *testing.T, up *upstream.Upstream, endpoints []string, adjust func(*relay.Config)) *cluster.Tier {
	t.Helper()
	var logger *slog.Logger
	if os.Getenv("MESHRELAY_TEST_LOG") != "" {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	tier, err := cluster.StartConvergedTier(context.Background(), cluster.TierConfig{Relays: 3, Upstream: up.Addr(), Etcd: endpoints,
		Logger: logger, Relay: adjust}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tier.Stop(context.Background()) })
	return tier
}

// startTierFleet starts envoys simulated Envoys of sc over keys keys on
// tier, stopped at the end of the test.
func startTierFleet(t *testing.T, sc upstream.Scenario, tier *cluster.Tier, envoys, keys int) *traffic.Fleet {
	t.Helper()
	f, err := traffic.StartFleet(context.Background(), traffic.FleetConfig{Scenario: sc, Envoys: envoys, Keys: keys, Target: tier.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Stop(context.Background()) })
	return f
}

// waitFleetSynced waits until every Envoy of f holds what up serves it.
func waitFleetSynced(t *testing.T, f *traffic.Fleet, up *upstream.Upstream, when string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	if err := f.WaitSynced(ctx, up); err != nil {
		t.Fatalf("%s: %v", when, err)
	}
}

// waitUntil polls cond until it holds, failing with its last state after
// 30 s.
func waitUntil(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s", what, state)
		}
	}
}

// TestOwnerRestartsWarmWhileConfigChurns: a relay killed and started again
// restores keys from etcd that are up to a second behind (the writers
// flush once a second) while the config keeps changing; when it becomes
// the owner again its peers subscribe to it while it is still stale. No
// Envoy, wherever it is connected, may be taken back to older content.
//
// It found SotW Envoys moved by a crash taken back to older content, with
// or without snapshots (NO_ETCD=1 runs it without), about one run in two,
// until SotW clients that report a version kept their config while a key is
// stale (76ed0ac). MESHRELAY_TEST_LOG=1 prints the relays' debug logs.
func TestOwnerRestartsWarmWhileConfigChurns(t *testing.T) {
	for _, proto := range []envoy.Protocol{envoy.SotW, envoy.Delta} {
		t.Run(proto.String(), func(t *testing.T) { ownerRestartsWarm(t, proto) })
	}
}

func ownerRestartsWarm(t *testing.T, proto envoy.Protocol) {
	ctx := context.Background()
	etcd := startEtcd(t, "")
	up, sc := startUpstream(t, upstream.Scenario{Services: 60, Endpoints: 120, Namespaces: 4, LocalFraction: 0.25})
	var logger *slog.Logger
	if os.Getenv("MESHRELAY_TEST_LOG") != "" {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	var etcdEndpoints []string
	if os.Getenv("NO_ETCD") == "" {
		etcdEndpoints = etcd.Endpoints()
	}
	tier, err := cluster.StartTier(ctx, cluster.TierConfig{Relays: 3, Upstream: up.Addr(), Etcd: etcdEndpoints, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tier.Stop(context.Background()) })
	// Bounds for liveness, not speed: a run beside other race-detector
	// tests and busy loops took more than 30 s to sync the fleet.
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := tier.WaitConverged(wctx); err != nil {
		t.Fatal(err)
	}
	fleet, err := traffic.StartFleet(ctx, traffic.FleetConfig{Scenario: sc, Envoys: 48, Keys: 12, Protocol: proto, Target: tier.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fleet.Stop(context.Background()) })
	if err := fleet.WaitSynced(wctx, up); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // every key persisted once

	churnCtx, stopChurn := context.WithCancel(ctx)
	churned := make(chan struct{})
	go func() {
		defer close(churned)
		for i := 0; ; i++ {
			select {
			case <-churnCtx.Done():
				return
			case <-time.After(50 * time.Millisecond):
			}
			if _, err := up.MoveEndpoint(i % sc.Endpoints); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	for _, i := range []int{0, 1} {
		if err := tier.StopRelay(ctx, i, false); err != nil {
			t.Fatal(err)
		}
		time.Sleep(700 * time.Millisecond)
		if err := tier.Start(ctx, i); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Second)
	}
	stopChurn()
	<-churned
	sctx, cancel2 := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel2()
	if err := tier.WaitConverged(sctx); err != nil {
		t.Fatal(err)
	}
	if err := fleet.WaitSynced(sctx, up); err != nil {
		t.Fatal(err)
	}
	for _, v := range fleet.Violations() {
		t.Errorf("protocol violation: %v", v)
	}
}
