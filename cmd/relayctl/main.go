// Command relayctl inspects a meshrelay tier through any relay's admin API
// (meshrelay.admin.v1): the ring, the shards, where each Envoy is and
// whether it is in sync, and the ledger's convergence, which it can wait
// for.
//
//	relayctl --admin-address relay-0:15014 proxy-status
//	relayctl wait --share 1.0 --timeout 30s --prefix sidecar/payments/
package main

import (
	"os"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}
