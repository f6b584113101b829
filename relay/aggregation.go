package relay

// Aggregation: which key a stream joins, the keys this relay holds, and
// how well they aggregate its Envoys.

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/meshrelay/meshrelay/relay/aggkey"
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

// aggregation reports how well the keys aggregate their Envoys. It takes
// no key's lock.
func (c *keyCache) aggregation() AggregationReport {
	var a AggregationReport
	for _, k := range c.heldKeys() {
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
func (c *keyCache) warnUnaggregated(ctx context.Context) {
	every := c.cfg.Keys.AggregationWarnInterval
	t := time.NewTimer(min(every, time.Minute))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if a := c.aggregation(); a.Off() {
			c.log.Warn(fmt.Sprintf("aggregation is off for %d of %d keys: each serves one Envoy and holds a stream to its source for it alone; if their nodes get the same config, key them together (--key-profile fields)", a.Lone, a.Keys),
				"key_profile", c.cfg.Keys.Profile.Name(), "examples", a.Examples)
		}
		t.Reset(every)
	}
}

// installKey creates key's state and starts its feed, with init run on
// both first, unless the key is held already or the relay is stopping,
// and reports whether it did. The warm start installs restored keys so.
func (c *keyCache) installKey(key aggkey.Key, init func(*keyState, *feed)) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped || c.keys[key] != nil {
		return false
	}
	c.startKeyLocked(key, init)
	return true
}

// startKeyLocked creates key's state and starts its feed, with init (if
// not nil) run on both first. The caller holds c.mu.
func (c *keyCache) startKeyLocked(key aggkey.Key, init func(*keyState, *feed)) *keyState {
	k := newKeyState(c, key)
	u := newFeed(k)
	if init != nil {
		init(k, u)
	}
	c.keys[key] = k
	// Refused only while stopping: the key's streams end then, unfed.
	c.host.goRun(u.run)
	return k
}

// heldKeys returns the keys held now.
func (c *keyCache) heldKeys() []*keyState {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Collect(maps.Values(c.keys))
}

// dropIfIdle forgets k if it still has no members, and reports whether it
// did. The key's feed calls it when its idle timer fires.
func (c *keyCache) dropIfIdle(k *keyState) bool {
	dropped := func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		k.mu.Lock()
		defer k.mu.Unlock()
		if len(k.members) > 0 {
			return false
		}
		delete(c.keys, k.key)
		// Under c.mu: a stream that takes the key again (join) must
		// not record its views before the ledger forgets the old ones.
		// The ledger never calls back.
		c.ledger.DropKey(string(k.key))
		return true
	}()
	if dropped {
		c.log.Debug("key dropped after idling", "key", k.key)
	}
	return dropped
}
