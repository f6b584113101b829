package relay

import (
	"context"
	"fmt"
	"slices"
	"time"
)

// MinLoneKeysToWarn is the fewest keys serving one Envoy each for which
// the relay warns that aggregation is off (AggregationWarnInterval): a
// handful of one-off proxies is no fleet.
const MinLoneKeysToWarn = 10

// AggregationReport says how well this relay's keys aggregate its Envoys.
type AggregationReport struct {
	// Keys counts the keys with a stream joined here; Lone those of them
	// that serve exactly one Envoy and no other relay, each holding a
	// source (an upstream or peer stream) for it alone.
	Keys, Lone int
	// Examples names up to three lone keys.
	Examples []string
}

// Off reports whether aggregation is off for most keys: at least
// MinLoneKeysToWarn keys, and more than half, are lone.
func (a AggregationReport) Off() bool { return a.Lone >= MinLoneKeysToWarn && 2*a.Lone > a.Keys }

// Aggregation reports how well this relay's keys aggregate its Envoys. It
// takes no key's lock. Safe for concurrent use.
func (r *Relay) Aggregation() AggregationReport {
	var a AggregationReport
	for _, k := range r.heldKeys() {
		if k.joined.Load() == 0 {
			continue // idle: about to be dropped
		}
		a.Keys++
		if k.lone() {
			a.Lone++
			a.Examples = append(a.Examples, string(k.key))
		}
	}
	slices.Sort(a.Examples) // the same examples from one scrape to the next
	a.Examples = a.Examples[:min(len(a.Examples), 3)]
	return a
}

// warnUnaggregated warns, every AggregationWarnInterval (the first time a
// minute after start, or sooner), while aggregation is off for most keys.
func (r *Relay) warnUnaggregated(ctx context.Context) {
	every := r.cfg.AggregationWarnInterval
	t := time.NewTimer(min(every, time.Minute))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if a := r.Aggregation(); a.Off() {
			r.log.Warn(fmt.Sprintf("aggregation is off for %d of %d keys: each serves one Envoy and holds a stream to its source for it alone; if their nodes get the same config, key them together (--key-profile fields)", a.Lone, a.Keys),
				"key_profile", r.cfg.KeyProfile.Name(), "examples", a.Examples)
		}
		t.Reset(every)
	}
}
