package divergence

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// TestSettledDifferences: a difference counts once it has lasted settle;
// churn (a resource whose content keeps changing on one side first, then
// the other) never does, and does not delay one that lasts.
func TestSettledDifferences(t *testing.T) {
	settle := (&Prober{Confirm: 2 * time.Second}).settle() // the relay's
	seen := make(map[difference]time.Time)
	start := time.Now()
	extra := difference{typeURL: xds.TypeListener, name: "inbound|10.0.0.3", onlyInCheck: true}
	var got []string
	for i := range 40 {
		now := start.Add(time.Duration(i) * 100 * time.Millisecond)
		// A push every 100 ms reaches the check's stream first: its
		// cluster differs until the key's view has it too.
		churn := difference{typeURL: xds.TypeCluster, name: "c0",
			got: ledger.HashBytes(fmt.Append(nil, i)), view: ledger.HashBytes(fmt.Append(nil, i-1))}
		got = settled(seen, []difference{churn, extra}, now, settle)
		lasted := now.Sub(start) >= settle
		if want := lasted; (len(got) > 0) != want {
			t.Fatalf("after %v: settled = %v, want the listener's type: %v", now.Sub(start), got, want)
		}
	}
	if !slices.Equal(got, []string{xds.TypeListener}) {
		t.Errorf("settled = %v, want only %s: the churning cluster never lasted", got, xds.TypeListener)
	}
	// A difference that goes away starts again when it comes back.
	settled(seen, nil, start.Add(5*time.Second), settle)
	if got := settled(seen, []difference{extra}, start.Add(5*time.Second+time.Millisecond), settle); len(got) != 0 {
		t.Errorf("a difference seen again counts at once: %v", got)
	}
}
