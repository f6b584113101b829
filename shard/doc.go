// Package shard will own membership (hashicorp/memberlist gossip), the
// consistent-hash ring (buraksezer/consistent) that says which relay owns
// which aggregation key, and connection balancing across relays.
//
// It is empty until the sharded tier lands (issue 3): today a relay owns
// every key it sees and holds its upstream stream itself.
package shard
