package shard_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
	"github.com/meshrelay/meshrelay/loadtest/upstream"
	"github.com/meshrelay/meshrelay/shard"
	"github.com/meshrelay/meshrelay/shard/adminpb"
)

// TestNodeAlone: a Node without a Ring is a relay alone (meshrelay serve
// --gossip-listen ""): it owns every key, serves its Envoys, and its admin
// API answers as for a tier of one; Stop drains and stops it (goleak
// checks nothing is left).
func TestNodeAlone(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sc := upstream.Scenario{Services: 6, Endpoints: 6, Namespaces: 2}
	up := startUpstream(t, sc)
	cfg := shard.DefaultNodeConfig()
	cfg.Relay.ID, cfg.Relay.Upstream.Addr, cfg.Relay.Logger = "alone", up.Addr(), testLogger()
	cfg.Relay.XDS.Listen, cfg.Relay.Admin.Listen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.DrainPeriod = 100 * time.Millisecond
	node, err := shard.NewNode(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if node.Ring() != nil {
		t.Fatalf("Ring() = %v, want nil for a relay alone", node.Ring())
	}
	if err := node.Start(ctx); err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			node.Stop(context.Background())
		}
	}()
	fleet, err := traffic.StartFleet(ctx, traffic.FleetConfig{Scenario: sc, Envoys: 6, Keys: 2, Protocol: envoy.Delta, Target: node.Relay().Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	defer fleet.Stop(context.Background())
	if err := fleet.WaitSynced(ctx, up); err != nil {
		t.Fatal(err)
	}

	conn, err := grpc.NewClient(node.Relay().AdminAddr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	admin := adminpb.NewAdminClient(conn)
	ring, err := admin.GetRing(ctx, &adminpb.GetRingRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(ring.GetMembers()) != 1 || !ring.GetMembers()[0].GetSelf() || ring.GetMembers()[0].GetName() != "alone" || ring.GetMembers()[0].GetEnvoys() != 6 {
		t.Errorf("GetRing().Members = %v, want only itself (alone, self, 6 Envoys)", ring.GetMembers())
	}
	shards, err := admin.ListShards(ctx, &adminpb.ListShardsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(shards.GetShards()) != 2 {
		t.Errorf("ListShards() = %d keys, want 2", len(shards.GetShards()))
	}
	for _, s := range shards.GetShards() {
		if s.GetOwner() != "alone" || s.GetEnvoys() != 3 {
			t.Errorf("shard %s: owner %q, %d Envoys; want owner alone, 3 Envoys", s.GetKey(), s.GetOwner(), s.GetEnvoys())
		}
	}
	stopped = true
	if err := node.Stop(ctx); err != nil {
		t.Errorf("Stop: %v", err)
	}
	if err := node.Stop(ctx); err != nil {
		t.Errorf("second Stop: %v, want nil (idempotent)", err)
	}
}
