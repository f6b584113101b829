package shard_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	envoyadmin "github.com/envoyproxy/go-control-plane/envoy/admin/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statusv3 "github.com/envoyproxy/go-control-plane/envoy/service/status/v3"
	resourcev3 "github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/meshrelay/meshrelay/ledger"
	inproc "github.com/meshrelay/meshrelay/loadtest/cluster"
	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/relay"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/shard/adminpb"
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
	sc := upstream.Scenario{Services: 12, Endpoints: 12, Namespaces: 3, LocalFraction: 0}
	up := startUpstream(t, sc)
	// No balancing: every answer is asserted exactly, and an Envoy moved
	// away from a relay above its share is a straggler while it reconnects.
	tier, err := inproc.StartConvergedTier(ctx, inproc.TierConfig{Relays: 3, Upstream: up.Addr(), Logger: testLogger(),
		BalanceInterval: time.Hour,
		Relay:           func(c *relay.Config) { c.Admin.Listen = "127.0.0.1:0" }}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tier.Stop(context.Background()) })

	const keys, envoys = 3, 12
	role := func(i int) string { return []string{"ok", "ok", "nack", "silent"}[i/keys] }
	var rejecting atomic.Bool
	fleet, err := traffic.StartFleet(ctx, traffic.FleetConfig{
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
	anyRelay := func(i int) *inproc.TierRelay { return tier.Running()[i%len(tier.Running())] }

	// Before the change: every Envoy but the silent ones is current.
	waitLedger(t, "initial sync", func() (bool, string) {
		tl := anyRelay(0).Node.Relay().TierLedger(ctx, ledger.Scope{}, ledger.Brief)
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
		h, _, err := wire.ParseVersion(held.Version)
		if err != nil {
			return false, err.Error()
		}
		newHash = h
		return held.Generation >= ch.Generation, "older generation"
	})

	waitLedger(t, "the change to settle", func() (bool, string) {
		tl := anyRelay(1).Node.Relay().TierLedger(ctx, ledger.Scope{}, ledger.Brief)
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
	report := anyRelay(2).Node.Relay().TierLedger(ctx, ledger.Scope{}, ledger.Full)
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
	if tl, err := anyRelay(1).Node.Relay().TierWait(wctx2, ledger.Scope{}, 0.5, nil); err != nil || tl.Convergence().Share() < 0.5 {
		t.Fatalf("TierWait(0.5) = %+v, %v", tl.Convergence(), err)
	}
	sctx, cancel3 := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel3()
	tl2, err := anyRelay(2).Node.Relay().TierWait(sctx, ledger.Scope{}, 1, nil)
	if !errors.Is(err, context.DeadlineExceeded) || len(tl2.Stragglers(0)) != 6 {
		t.Fatalf("TierWait(1.0) = %d stragglers, %v; want 6 and the deadline", len(tl2.Stragglers(0)), err)
	}
	// One key: its Envoys only.
	key := report.Stragglers(0)[0].Key
	if c := anyRelay(0).Node.Relay().TierLedger(ctx, ledger.Scope{Key: key}, ledger.Brief).Convergence(); c != (ledger.Convergence{Envoys: 4, Current: 2}) {
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
	checkAdminAPI(t, tier, byRole, edsType, ch.Name, newHash)
	checkSyncz(t, tier, byRole)

	for _, v := range fleet.Violations() {
		t.Errorf("protocol violation: %v", v)
	}
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
func histogramCount(t *testing.T, r *inproc.TierRelay, name string) uint64 {
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

// checkAdminAPI asks the same questions of the admin API (meshrelay.admin.v1)
// on another relay's admin listener, in the state TestLedgerQueries left:
// the answers must be the ledger's, in the API's terms.
func checkAdminAPI(t *testing.T, tier *inproc.Tier, byRole map[string][]string, typeURL, name string, hash ledger.Hash) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	asked := tier.Running()[2]
	conn, err := grpc.NewClient(asked.Node.Relay().AdminAddr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := adminpb.NewAdminClient(conn)

	ring, err := c.GetRing(ctx, &adminpb.GetRingRequest{})
	if err != nil {
		t.Fatal(err)
	}
	selves := 0
	for _, m := range ring.GetMembers() {
		if m.GetSelf() {
			selves++
		}
		if m.GetState() != "alive" {
			t.Errorf("GetRing: member %s is %q, want alive", m.GetName(), m.GetState())
		}
	}
	if ring.GetRelay() != asked.ID || len(ring.GetMembers()) != 3 || selves != 1 {
		t.Fatalf("GetRing = %v, want relay %s, 3 members, one of them self", ring, asked.ID)
	}

	shards, err := c.ListShards(ctx, &adminpb.ListShardsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	total := int64(0)
	for _, sh := range shards.GetShards() {
		total += sh.GetEnvoys()
		owner, ok := asked.Node.Ring().Locate(sh.GetKey())
		if !ok || sh.GetOwner() != owner.Name || sh.GetOwnerXdsAddress() != owner.XDSAddr {
			t.Errorf("shard %s: owner %s (%s), the ring says %s (%s)", sh.GetKey(), sh.GetOwner(), sh.GetOwnerXdsAddress(), owner.Name, owner.XDSAddr)
		}
		if sh.GetEnvoys() != 4 || sh.GetCurrent() != 2 {
			t.Errorf("shard %s: %d of %d Envoys current, want 2 of 4", sh.GetKey(), sh.GetCurrent(), sh.GetEnvoys())
		}
		upstream := 0
		for _, h := range sh.GetHolders() {
			switch h.GetSource() {
			case string(ledger.SourceUpstream):
				upstream++
				if !strings.HasPrefix(sh.GetOwner(), h.GetRelay()+"-") {
					t.Errorf("shard %s: %s holds the upstream stream, the owner is %s", sh.GetKey(), h.GetRelay(), sh.GetOwner())
				}
				if h.GetLedgerVersion() != sh.GetLedgerVersion() {
					t.Errorf("shard %s: owner's ledger version %s, the shard's %s", sh.GetKey(), h.GetLedgerVersion(), sh.GetLedgerVersion())
				}
			case string(ledger.SourcePeer):
			default:
				t.Errorf("shard %s: holder %s has source %q", sh.GetKey(), h.GetRelay(), h.GetSource())
			}
		}
		if upstream != 1 {
			t.Errorf("shard %s: %d holders with the upstream stream, want 1", sh.GetKey(), upstream)
		}
	}
	if len(shards.GetShards()) != 3 || total != 12 || len(shards.GetMissing()) != 0 {
		t.Fatalf("ListShards: %d shards, %d Envoys, missing %v; want 3, 12, none", len(shards.GetShards()), total, shards.GetMissing())
	}

	conv, err := c.GetConvergence(ctx, &adminpb.ConvergenceRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if tc := conv.GetTier(); tc.GetEnvoys() != 12 || tc.GetCurrent() != 6 || tc.GetShare() != 0.5 || len(conv.GetByKey()) != 3 {
		t.Fatalf("GetConvergence = %v, want 6 of 12 over 3 keys", conv)
	}

	ss, err := c.ListStragglers(ctx, &adminpb.StragglersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, s := range ss.GetStragglers() {
		got[s.GetNode()] = s.GetReason()
		if s.GetReason() == string(ledger.NACKed) && (s.GetNack().GetFingerprint() == "" || s.GetSince() == nil) {
			t.Errorf("straggler %s: NACK %v since %v, want a fingerprint and a time", s.GetNode(), s.GetNack(), s.GetSince())
		}
	}
	want := map[string]string{}
	for _, n := range byRole["nack"] {
		want[n] = string(ledger.NACKed)
	}
	for _, n := range byRole["silent"] {
		want[n] = string(ledger.NotACKed)
	}
	if !maps.Equal(got, want) {
		t.Fatalf("ListStragglers = %v, want %v", got, want)
	}
	if ss, _ := c.ListStragglers(ctx, &adminpb.StragglersRequest{Limit: 2}); len(ss.GetStragglers()) != 2 {
		t.Fatalf("ListStragglers(limit 2) = %d stragglers", len(ss.GetStragglers()))
	}

	d, err := c.CheckDelivery(ctx, &adminpb.DeliveryRequest{Type: typeURL, Name: name, Hash: hash.String()})
	if err != nil {
		t.Fatal(err)
	}
	if d.GetEnvoys() != 12 || d.GetDelivered() != 6 || !d.GetKnown() || d.GetDone() || len(d.GetMissing()) != 6 {
		t.Fatalf("CheckDelivery = %v, want 6 of 12 delivered, known, 6 missing", d)
	}
	if _, err := c.CheckDelivery(ctx, &adminpb.DeliveryRequest{Type: typeURL, Name: name, Hash: "nope"}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("CheckDelivery(bad hash) err = %v, want InvalidArgument", err)
	}

	// Where is a NACKing Envoy, and what does it hold?
	nacker := byRole["nack"][0]
	info, err := c.LocateEnvoy(ctx, &adminpb.LocateEnvoyRequest{Node: nacker})
	if err != nil {
		t.Fatal(err)
	}
	onRelay := ""
	for _, r := range tier.Running() {
		for _, cs := range r.Node.Relay().Clients() {
			if cs.NodeID == nacker && cs.PeerRelay == "" {
				onRelay = r.ID
			}
		}
	}
	owner, _ := asked.Node.Ring().Locate(info.GetKey())
	var edsState *adminpb.EnvoyType
	for _, et := range info.GetTypes() {
		if et.GetType() == typeURL {
			edsState = et
		}
	}
	if info.GetRelay() != onRelay || info.GetOwner() != owner.Name || info.GetCurrent() || info.GetReason() != string(ledger.NACKed) ||
		!info.GetConnected() || edsState == nil || edsState.GetNack() == nil || edsState.GetAcked() == edsState.GetCurrentView() {
		t.Fatalf("LocateEnvoy(%s) = %v; want it on %s, owner %s, NACKing its endpoints, behind", nacker, info, onRelay, owner.Name)
	}
	// GetShard: the key in detail, from each holder; the origin lists the
	// other holders as subscribed to it.
	sd, err := c.GetShard(ctx, &adminpb.GetShardRequest{Key: info.GetKey()})
	if err != nil {
		t.Fatal(err)
	}
	var holderNames, peersOfOrigin []string
	envoysOf := map[string]int64{}
	for _, h := range sd.GetShard().GetHolders() {
		holderNames, envoysOf[h.GetRelay()] = append(holderNames, h.GetRelay()), h.GetEnvoys()
	}
	var detailNames []string
	var cdsCount int64 = -1
	for _, d := range sd.GetHolders() {
		detailNames = append(detailNames, d.GetRelay())
		if d.GetEnvoys() != envoysOf[d.GetRelay()] {
			t.Errorf("GetShard: %s tells %d Envoys, the ledger %d", d.GetRelay(), d.GetEnvoys(), envoysOf[d.GetRelay()])
		}
		if d.GetSource() == "upstream" {
			peersOfOrigin = d.GetPeers()
		}
		for _, td := range d.GetTypes() {
			if td.GetType() == cdsType {
				if cdsCount >= 0 && td.GetResources() != cdsCount {
					t.Errorf("GetShard: holders disagree on the clusters: %d and %d", cdsCount, td.GetResources())
				}
				cdsCount = td.GetResources()
			}
		}
	}
	others := slices.DeleteFunc(slices.Clone(holderNames), func(r string) bool { return strings.HasPrefix(sd.GetShard().GetOwner(), r+"-") })
	if !slices.Equal(detailNames, holderNames) || !slices.Equal(peersOfOrigin, others) || cdsCount <= 0 || len(sd.GetMissing()) != 0 {
		t.Fatalf("GetShard(%s) = %v; want every holder %v in detail, the origin's peers %v, clusters", info.GetKey(), sd, holderNames, others)
	}
	if _, err := c.GetShard(ctx, &adminpb.GetShardRequest{Key: "no/such/key"}); status.Code(err) != codes.NotFound {
		t.Fatalf("GetShard(no/such/key) err = %v, want NotFound", err)
	}

	// GetConfigDump of a node, asked of a relay it may not be connected to:
	// the relay it is on answers, with its clusters.
	for _, asJSON := range []bool{false, true} {
		d, err := c.GetConfigDump(ctx, &adminpb.ConfigDumpRequest{Node: nacker, Json: asJSON, Types: []string{cdsType}})
		if err != nil {
			t.Fatal(err)
		}
		if d.GetRelay() != onRelay || d.GetKey() != info.GetKey() {
			t.Fatalf("GetConfigDump(%s) from %s of key %s, want %s of %s", nacker, d.GetRelay(), d.GetKey(), onRelay, info.GetKey())
		}
		var clusters int
		if asJSON {
			// (protojson varies its spacing from run to run.)
			clusters = len(regexp.MustCompile(`"@type":\s*"type.googleapis.com/envoy.config.cluster.v3.Cluster"`).FindAllString(d.GetJson(), -1))
			if d.GetConfigDump() != nil || !strings.Contains(d.GetJson(), `"dynamic_active_clusters"`) {
				t.Fatalf("GetConfigDump as JSON: any %v, json without dynamic_active_clusters", d.GetConfigDump())
			}
		} else {
			var cd envoyadmin.ConfigDump
			var cl envoyadmin.ClustersConfigDump
			if err := d.GetConfigDump().UnmarshalTo(&cd); err != nil || len(cd.GetConfigs()) != 1 || cd.GetConfigs()[0].UnmarshalTo(&cl) != nil {
				t.Fatalf("GetConfigDump: %v, want one ClustersConfigDump: %v", cd.GetConfigs(), err)
			}
			clusters = len(cl.GetDynamicActiveClusters())
		}
		if int64(clusters) != cdsCount {
			t.Errorf("GetConfigDump (json %v): %d clusters, the key has %d", asJSON, clusters, cdsCount)
		}
	}
	if _, err := c.GetConfigDump(ctx, &adminpb.ConfigDumpRequest{Node: "nobody"}); status.Code(err) != codes.NotFound {
		t.Fatalf("GetConfigDump(nobody) err = %v, want NotFound", err)
	}

	// Each type's status, in istioctl's terms, follows the Envoy's role:
	// the silent ones never answered their first response.
	all, err := c.ListEnvoys(ctx, &adminpb.ListEnvoysRequest{})
	if err != nil {
		t.Fatal(err)
	}
	roleOf := map[string]string{}
	for r, nodes := range byRole {
		for _, n := range nodes {
			roleOf[n] = r
		}
	}
	for _, e := range all.GetEnvoys() {
		for _, et := range e.GetTypes() {
			want := map[string]string{"ok": "SYNCED", "nack": "SYNCED", "silent": "STALE"}[roleOf[e.GetNode()]]
			if roleOf[e.GetNode()] == "nack" && et.GetType() == typeURL {
				want = "NACKED"
			}
			if et.GetStatus() != want {
				t.Errorf("ListEnvoys: %s (%s) %s status %q, want %q", e.GetNode(), roleOf[e.GetNode()], et.GetType(), et.GetStatus(), want)
			}
		}
	}
	// The basic view says the same statuses, the types listed once.
	basic, err := c.ListEnvoys(ctx, &adminpb.ListEnvoysRequest{View: adminpb.EnvoyView_ENVOY_VIEW_BASIC})
	if err != nil {
		t.Fatal(err)
	}
	fullStatus := map[string]string{}
	for _, e := range all.GetEnvoys() {
		for _, et := range e.GetTypes() {
			fullStatus[e.GetNode()+" "+et.GetType()] = et.GetStatus()
		}
	}
	basicStatus := map[string]string{}
	for _, e := range basic.GetEnvoys() {
		if len(e.GetTypes()) != 0 || e.GetConnectedAt() != nil || len(e.GetStatuses()) != len(basic.GetStatusTypes()) {
			t.Fatalf("basic view of %s = %v, want statuses only, one per status type %v", e.GetNode(), e, basic.GetStatusTypes())
		}
		for i, st := range e.GetStatuses() {
			if st != adminpb.SyncStatus_SYNC_STATUS_UNSPECIFIED {
				basicStatus[e.GetNode()+" "+basic.GetStatusTypes()[i]] = strings.ReplaceAll(st.String(), "_", " ")
			}
		}
	}
	if !maps.Equal(basicStatus, fullStatus) || len(basic.GetEnvoys()) != len(all.GetEnvoys()) || basic.GetStatusTypes()[0] != cdsType {
		t.Fatalf("basic view statuses %v (types %v)\nwant the full view's %v", basicStatus, basic.GetStatusTypes(), fullStatus)
	}
	if _, err := c.LocateEnvoy(ctx, &adminpb.LocateEnvoyRequest{Node: "nobody"}); status.Code(err) != codes.NotFound {
		t.Fatalf("LocateEnvoy(nobody) err = %v, want NotFound", err)
	}
	for _, tc := range []struct {
		req  *adminpb.ListEnvoysRequest
		want int
	}{
		{&adminpb.ListEnvoysRequest{}, 12},
		{&adminpb.ListEnvoysRequest{Lagging: true}, 6},
		{&adminpb.ListEnvoysRequest{Nacking: true}, 3},
		{&adminpb.ListEnvoysRequest{Selector: &adminpb.Selector{Key: info.GetKey()}}, 4},
		{&adminpb.ListEnvoysRequest{Relay: onRelay, Nacking: true, Limit: 1}, 1},
	} {
		l, err := c.ListEnvoys(ctx, tc.req)
		if err != nil || len(l.GetEnvoys()) != tc.want {
			t.Fatalf("ListEnvoys(%v) = %d Envoys, %v; want %d", tc.req, len(l.GetEnvoys()), err, tc.want)
		}
	}

	// Wait: half the tier is there at once; all of it never comes.
	w, err := c.Wait(ctx, &adminpb.WaitRequest{Share: 0.5, Timeout: durationpb.New(10 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	var last *adminpb.Convergence
	for {
		m, err := w.Recv()
		if err != nil {
			break
		}
		last = m
	}
	if !last.GetReached() {
		t.Fatalf("Wait(0.5): last message %v, want reached", last)
	}
	w, err = c.Wait(ctx, &adminpb.WaitRequest{Share: 1, Timeout: durationpb.New(300 * time.Millisecond)})
	if err != nil {
		t.Fatal(err)
	}
	for {
		m, err := w.Recv()
		if err != nil {
			if status.Code(err) != codes.DeadlineExceeded || last.GetReached() || len(last.GetStragglers()) != 6 {
				t.Fatalf("Wait(1.0) ended with %v after %v; want DEADLINE_EXCEEDED after a message with the 6 stragglers", err, last)
			}
			break
		}
		last = m
	}
	// A bad request's error comes with the stream's first Recv.
	w, _ = c.Wait(ctx, &adminpb.WaitRequest{Share: 2})
	if _, err := w.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Wait(share 2) err = %v, want InvalidArgument", err)
	}
}

// checkSyncz asks a relay istiod's debug type URLs over ADS, as istioctl
// proxy-status --xds-address does, and decodes the answers as istioctl
// does: a CSDS ClientConfig per Envoy of the tier, each type's status
// following the Envoy's role; the control plane identifier istiod's JSON.
// Then a node's config dump, as istioctl x internal-debug asks it.
func checkSyncz(t *testing.T, tier *inproc.Tier, byRole map[string][]string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	asked := tier.Running()[1]
	conn, err := grpc.NewClient(asked.Node.Relay().Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ask := func(typeURL string, names ...string) *discovery.DiscoveryResponse {
		t.Helper()
		ads, err := discovery.NewAggregatedDiscoveryServiceClient(conn).StreamAggregatedResources(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer ads.CloseSend()
		// istioctl's node: no metadata, so it never joins a key.
		if err := ads.Send(&discovery.DiscoveryRequest{TypeUrl: typeURL, ResourceNames: names,
			Node: &core.Node{Id: "debug~0.0.0.0~istioctl-1~.svc.cluster.local"}}); err != nil {
			t.Fatal(err)
		}
		resp, err := ads.Recv()
		if err != nil {
			t.Fatalf("%s: %v", typeURL, err)
		}
		return resp
	}

	resp := ask("istio.io/debug/syncz")
	var cp struct {
		Component, ID string
		Info          struct {
			Version string `json:"version"`
		}
	}
	if err := json.Unmarshal([]byte(resp.GetControlPlane().GetIdentifier()), &cp); err != nil || cp.ID != asked.ID {
		t.Fatalf("syncz control plane %q: %v; want istiod's JSON naming %s", resp.GetControlPlane().GetIdentifier(), err, asked.ID)
	}
	// As istiod's: the types each Envoy subscribed to (these never ask
	// for ECDS, so it is not listed).
	want := map[string]string{
		"ok":     "CDS=SYNCED EDS=SYNCED LDS=SYNCED RDS=SYNCED ECDS=",
		"nack":   "CDS=SYNCED EDS=ERROR LDS=SYNCED RDS=SYNCED ECDS=",
		"silent": "CDS=STALE EDS=STALE LDS=STALE RDS=STALE ECDS=",
	}
	short := map[string]string{cdsType: "CDS", edsType: "EDS", resourcev3.ListenerType: "LDS", resourcev3.RouteType: "RDS",
		resourcev3.ExtensionConfigType: "ECDS"}
	got := map[string]string{}
	for _, r := range resp.GetResources() {
		if r.GetTypeUrl() != "type.googleapis.com/envoy.service.status.v3.ClientConfig" {
			t.Fatalf("syncz resource of type %s", r.GetTypeUrl())
		}
		var cc statusv3.ClientConfig
		if err := r.UnmarshalTo(&cc); err != nil {
			t.Fatalf("could not unmarshal ClientConfig: %v", err)
		}
		status := map[string]string{}
		for _, g := range cc.GetGenericXdsConfigs() {
			status[short[g.GetTypeUrl()]] = g.GetConfigStatus().String()
		}
		got[cc.GetNode().GetId()] = fmt.Sprintf("CDS=%s EDS=%s LDS=%s RDS=%s ECDS=%s", status["CDS"], status["EDS"], status["LDS"], status["RDS"], status["ECDS"])
	}
	n := 0
	for role, nodes := range byRole {
		for _, node := range nodes {
			n++
			if got[node] != want[role] {
				t.Errorf("syncz: %s (%s) = %q, want %q", node, role, got[node], want[role])
			}
		}
	}
	if len(got) != n {
		t.Errorf("syncz lists %d Envoys, the tier has %d", len(got), n)
	}

	nacker := byRole["nack"][0]
	dump := ask("istio.io/debug/config_dump", nacker)
	var sections []string
	for _, r := range dump.GetResources() {
		sections = append(sections, r.GetTypeUrl()[strings.LastIndex(r.GetTypeUrl(), ".")+1:])
	}
	if want := []string{"ClustersConfigDump", "EndpointsConfigDump", "ListenersConfigDump", "RoutesConfigDump"}; !slices.Equal(sections, want) {
		t.Errorf("config_dump of %s: sections %v, want %v", nacker, sections, want)
	}
	if none := ask("istio.io/debug/config_dump", "nobody"); len(none.GetResources()) != 0 {
		t.Errorf("config_dump of an unknown node: %d resources, want none (as istiod)", len(none.GetResources()))
	}
}
