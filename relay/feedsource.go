package relay

import "time"

// A key's source: where its config comes from (the upstream, or the
// relay that owns the key, or the upstream while the owner cannot be
// reached: feed.choose and feed.fallBack).

// sourceKind says where a key's config comes from.
type sourceKind int32

const (
	// sourceUpstream: the relay owns the key (or serves it to peers) and
	// holds its upstream stream.
	sourceUpstream sourceKind = iota
	// sourcePeer: another relay owns the key; this one subscribes to it.
	sourcePeer
	// sourceFallback: the owner cannot be reached; the relay holds an
	// upstream stream itself until it can.
	sourceFallback
)

func (k sourceKind) String() string {
	switch k {
	case sourcePeer:
		return "peer"
	case sourceFallback:
		return "fallback"
	}
	return "upstream"
}

// source is a key's source: a kind, and the owner's address unless the
// relay owns the key.
type source struct {
	kind sourceKind
	addr string
}

// peerRetryInterval is how often a key in fallback checks whether its owner
// is reachable again.
const peerRetryInterval = 2 * time.Second

// A session whose key moved to another owner goes on until the new owner can
// be reached, checked every switchRetryInterval, for at most switchPatience.
const (
	switchRetryInterval = 100 * time.Millisecond
	switchPatience      = 3 * time.Second
)
