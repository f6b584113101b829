// Package shard owns the tier's membership and key ownership: gossip
// (hashicorp/memberlist) that finds the other relays, and the
// consistent-hash ring with bounded loads (buraksezer/consistent) that says
// which relay owns which aggregation key — the one relay that holds the
// key's upstream stream.
//
// A Ring joins the tier by addresses or by a DNS name (the headless
// Service), rejoins periodically so that long partitions heal, encrypts
// gossip with a shared key and labels it with the cluster's name so that two
// tiers never merge, and gossips each relay's xDS address and Envoy
// connection count. It answers Owner(key) for the relay's data path and
// FairShare for connection balancing (both interfaces are declared in
// package relay).
//
// Node is the one place a whole relay is assembled: its listeners, its
// snapshot store, its ring (none for a relay alone), its admin API and their
// lifecycle, in the order Start and Stop give them. meshrelay serve in every
// mode, the demo, the loadtest children and the tests of a whole relay build
// a Node; nothing else calls relay.New.
package shard
