package cluster

import "context"

// Cluster is a tier of relays behind one Service, as a scenario drives it:
// relays in this process (Tier) or `meshrelay serve` processes
// (loadtest.RelayProcs). A scenario written once against it runs in
// process in the tests and drives the binaries in end-to-end runs, as
// etcd's robustness tests drive their clusters.
//
// Relays are numbered 0 … Slots()-1; a slot keeps its number across
// restarts (a StatefulSet's pod, or a Deployment's replica).
type Cluster interface {
	// Addr is the Service's address: what Envoys dial.
	Addr() string
	// Slots is the number of relay slots, running or not.
	Slots() int
	// Start starts slot i (again): a new incarnation, as after a pod restart.
	Start(ctx context.Context, i int) error
	// StopRelay stops slot i: gracefully (it leaves the ring and drains
	// its streams, as on SIGTERM) or as a crash.
	StopRelay(ctx context.Context, i int, graceful bool) error
	// Ready reports whether slot i runs and is ready: the Service sends
	// new connections to it.
	Ready(i int) bool
	// Stop ends every relay and the Service.
	Stop(ctx context.Context)
}

var _ Cluster = (*Tier)(nil)
