package snapshot_test

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/aggkey"
	"github.com/meshrelay/meshrelay/relay/snapshot"
)

// TestPerNodeKeysTier: a tier keying every Envoy by its node (the mode of
// a fleet no profile aggregates) holds one upstream stream per Envoy,
// persists every key, answers for every Envoy in its ledger, counts every
// key as serving one Envoy, follows a change, and, restarted whole while
// the upstream is down, serves the same Envoys from etcd alone.
func TestPerNodeKeysTier(t *testing.T) {
	ctx := context.Background()
	endpoints := startEtcd(t, "").Endpoints()
	up, sc := startUpstream(t, upstream.Scenario{Services: 20, Endpoints: 20, Namespaces: 2, LocalFraction: 0.25})
	const envoys = 9
	startTier := func() *cluster.Tier {
		return startPersistingTier(t, up, endpoints, func(c *relay.Config) { c.Keys.Profile = aggkey.PerNode{} })
	}
	waitFor := func(what string, cond func() (bool, string)) { t.Helper(); waitUntil(t, what, cond) }
	synced := func(f *traffic.Fleet, when string) { t.Helper(); waitFleetSynced(t, f, up, when) }
	startFleet := func(tier *cluster.Tier) *traffic.Fleet { return startTierFleet(t, sc, tier, envoys, 3) }

	tier := startTier()
	fleet := startFleet(tier)
	synced(fleet, "initial sync")
	waitFor("one upstream stream per Envoy", func() (bool, string) {
		return up.Stats().OpenStreams == envoys, "upstream streams: " + itoa(int(up.Stats().OpenStreams))
	})
	waitFor("every key persisted", func() (bool, string) {
		n, err := persistedKeys(t, endpoints)
		return err == nil && n == envoys, "persisted keys: " + itoa(n)
	})
	persisted := func(when string) {
		t.Helper()
		waitFor(when+": etcd holds the latest config", func() (bool, string) { return persistedMatches(t, endpoints, up, envoys) })
	}
	waitFor("the ledger counts every Envoy current, each its key's only one", func() (bool, string) {
		tl := tier.Running()[0].Node.Relay().TierLedger(ctx, ledger.Scope{}, ledger.Brief)
		lone := 0
		for _, r := range tier.Running() {
			lone += r.Node.Relay().Aggregation().Lone
		}
		c := tl.Convergence()
		return c == (ledger.Convergence{Envoys: envoys, Current: envoys}) && len(tl.Keys()) == envoys && lone == envoys,
			"convergence " + itoa(c.Current) + "/" + itoa(c.Envoys) + ", keys " + itoa(len(tl.Keys())) + ", lone " + itoa(lone)
	})
	if _, err := up.MoveEndpoint(0); err != nil {
		t.Fatal(err)
	}
	synced(fleet, "after a change")
	persisted("after a change")

	// The whole tier goes, then the upstream; a new tier serves the same
	// nodes (so the same keys) the latest config from etcd alone.
	fleet.Stop(ctx)
	tier.Stop(ctx)
	if err := up.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	tier2 := startTier()
	fleet2 := startFleet(tier2)
	synced(fleet2, "a new tier, upstream down")
	for _, f := range []*traffic.Fleet{fleet, fleet2} {
		for _, v := range f.Violations() {
			t.Errorf("protocol violation: %v", v)
		}
	}
}

// persistedKeys counts the keys etcd holds, checking each is a per-node
// key.
func persistedKeys(t *testing.T, endpoints []string) (int, error) {
	cfg := snapshot.DefaultConfig()
	cfg.Endpoints, cfg.Member = endpoints, "reader"
	s, err := snapshot.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop(context.Background())
	saved, err := s.Load(t.Context())
	if err != nil {
		return 0, err
	}
	for _, k := range saved {
		if !strings.HasPrefix(k.Key, "node/") {
			t.Fatalf("persisted key %q is not a per-node key", k.Key)
		}
	}
	return len(saved), nil
}

func itoa(n int) string { return strconv.Itoa(n) }
