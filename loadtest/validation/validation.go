// Package validation is the history checker of the chaos suite and the
// deterministic simulation, in the manner of etcd's robustness tests: a
// run records every simulated Envoy's complete event history and
// everything the upstream published, and Check decides afterwards, from
// the records alone, whether the tier kept its promises. It does not
// trust the simulated Envoys' own checks: it rebuilds what each Envoy held
// from its events.
package validation

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/meshrelay/meshrelay/loadtest/envoy"
	"github.com/meshrelay/meshrelay/loadtest/traffic"
)

// Published is one resource change the upstream published to one group:
// a new generation of the resource, or its removal.
type Published struct {
	At         time.Time
	Group      string
	Key        traffic.ResourceKey
	Generation uint64 // the new generation; 0 for a removal
	Removed    bool
}

// EnvoyHistory is one Envoy's complete event history, in order.
type EnvoyHistory struct {
	ID     string
	Group  string
	Events []envoy.Event
}

// History is what a chaos run recorded.
type History struct {
	// Initial is what the upstream served each group (resource →
	// generation) before the first Published change.
	Initial map[string]map[traffic.ResourceKey]uint64
	// Published lists every change after Initial, in order of At.
	Published []Published
	// Envoys are the simulated Envoys' histories.
	Envoys []EnvoyHistory
	// End is when recording stopped. Every change must have reached every
	// Envoy of its group by then.
	End time.Time
}

// Config configures Check.
type Config struct {
	// DeliveryBound is how long a published change may take to reach
	// (be ACKed by, or removed from) every Envoy of its group.
	DeliveryBound time.Duration
}

// Rules the checker applies.
const (
	RuleRegression = "version-regression" // a resource went back to an older generation
	RuleRemoval    = "unexpected-removal" // a resource the upstream still served was removed
	RuleNonce      = "nonce-order"        // nonces reused, out of order, or ACKed unseen
	RuleLate       = "late-delivery"      // a change reached an Envoy after DeliveryBound
	RuleUndeliver  = "not-delivered"      // a change never reached an Envoy
	RuleEndState   = "end-state"          // at the end an Envoy does not hold its group's state
)

// Violation is one broken rule, at one event of one Envoy.
type Violation struct {
	Rule   string
	Envoy  string
	At     time.Time
	Event  int // index in the Envoy's history; -1 if none
	Detail string
}

func (v Violation) String() string {
	return fmt.Sprintf("%s: %s at %s (event %d): %s", v.Rule, v.Envoy, v.At.Format("15:04:05.000"), v.Event, v.Detail)
}

// ChangeDelivery is when one published change (every group it went to)
// had reached every Envoy that must get it.
type ChangeDelivery struct {
	At  time.Time // published
	Key traffic.ResourceKey
	// Last is the latency of the last Envoy to get it (its ACK, or its
	// removal).
	Last time.Duration
	// Done is At + Last.
	Done time.Time
}

// Result is what Check found.
type Result struct {
	// Violations, in order of time.
	Violations []Violation
	// Changes are the published changes with their delivery, in order of
	// publication (one per change, however many groups it reached).
	Changes []ChangeDelivery
}

// held is what an Envoy holds of one resource.
type heldRes struct{ gen uint64 }

// pendingChange is a published change not yet covered at one Envoy.
type pendingChange struct {
	p   Published
	idx int // index into the merged changes
}

// Check checks h against every rule.
func Check(h History, cfg Config) Result {
	// Per group, the resource timelines, for "does the upstream serve it at
	// t" and for the changes an Envoy must get.
	byGroup := map[string][]Published{}
	for _, p := range h.Published {
		byGroup[p.Group] = append(byGroup[p.Group], p)
	}
	// Changes merged over groups: one per (At, Key).
	type ck struct {
		at  int64
		key traffic.ResourceKey
	}
	changeIx := map[ck]int{}
	var res Result
	for _, p := range h.Published {
		k := ck{p.At.UnixNano(), p.Key}
		if _, ok := changeIx[k]; !ok {
			changeIx[k] = len(res.Changes)
			res.Changes = append(res.Changes, ChangeDelivery{At: p.At, Key: p.Key, Done: p.At})
		}
	}
	for _, e := range h.Envoys {
		tl := newTimeline(h.Initial[e.Group], byGroup[e.Group])
		res.Violations = append(res.Violations, checkEnvoy(e, tl, byGroup[e.Group], func(p Published) int {
			return changeIx[ck{p.At.UnixNano(), p.Key}]
		}, &res, h.End, cfg)...)
	}
	slices.SortStableFunc(res.Violations, func(a, b Violation) int { return a.At.Compare(b.At) })
	return res
}

// timeline answers what the upstream served a group at a time.
type timeline struct {
	initial map[traffic.ResourceKey]uint64
	byKey   map[traffic.ResourceKey][]Published
}

func newTimeline(initial map[traffic.ResourceKey]uint64, pubs []Published) *timeline {
	t := &timeline{initial: initial, byKey: map[traffic.ResourceKey][]Published{}}
	for _, p := range pubs {
		t.byKey[p.Key] = append(t.byKey[p.Key], p)
	}
	return t
}

// served reports whether key was served at t, and its generation.
func (t *timeline) served(key traffic.ResourceKey, at time.Time) (uint64, bool) {
	gen, ok := t.initial[key]
	for _, p := range t.byKey[key] {
		if p.At.After(at) {
			break
		}
		gen, ok = p.Generation, !p.Removed
	}
	return gen, ok
}

// final returns what the group is served after every change.
func (t *timeline) final() map[traffic.ResourceKey]uint64 {
	out := maps.Clone(t.initial)
	if out == nil {
		out = map[traffic.ResourceKey]uint64{}
	}
	for key, ps := range t.byKey {
		last := ps[len(ps)-1]
		if last.Removed {
			delete(out, key)
		} else {
			out[key] = last.Generation
		}
	}
	return out
}

func checkEnvoy(e EnvoyHistory, tl *timeline, pubs []Published, changeOf func(Published) int, res *Result, end time.Time, cfg Config) []Violation {
	var out []Violation
	violate := func(rule string, i int, at time.Time, format string, args ...any) {
		out = append(out, Violation{Rule: rule, Envoy: e.ID, At: at, Event: i, Detail: fmt.Sprintf(format, args...)})
	}
	held := map[traffic.ResourceKey]heldRes{}
	maxGen := map[traffic.ResourceKey]uint64{}
	// Nonces of the current stream.
	seen := map[string]string{} // nonce → type URL
	var lastNonce uint64
	numeric := true

	pending := map[traffic.ResourceKey][]pendingChange{}
	next := 0 // next of pubs to activate
	deliver := func(pc pendingChange, at time.Time) {
		lat := max(at.Sub(pc.p.At), 0)
		if lat > cfg.DeliveryBound {
			violate(RuleLate, -1, at, "%s generation %d (removed %v) published %s reached it after %v, bound %v",
				pc.p.Key, pc.p.Generation, pc.p.Removed, pc.p.At.Format("15:04:05.000"), lat.Round(time.Millisecond), cfg.DeliveryBound)
		}
		c := &res.Changes[pc.idx]
		if lat > c.Last {
			c.Last, c.Done = lat, pc.p.At.Add(lat)
		}
	}
	// covers reports whether what is held of key now covers change p.
	covers := func(key traffic.ResourceKey, p Published, at time.Time) bool {
		h, ok := held[key]
		if p.Removed {
			return !ok
		}
		if ok {
			return h.gen >= p.Generation
		}
		// Not held: covered if the upstream no longer serves it (a later
		// removal made the change moot).
		_, served := tl.served(key, at)
		return !served
	}
	settle := func(key traffic.ResourceKey, at time.Time) {
		ps := pending[key]
		kept := ps[:0]
		for _, pc := range ps {
			if covers(key, pc.p, at) {
				deliver(pc, at)
			} else {
				kept = append(kept, pc)
			}
		}
		if len(kept) == 0 {
			delete(pending, key)
		} else {
			pending[key] = kept
		}
	}
	activate := func(upTo time.Time) {
		for ; next < len(pubs) && !pubs[next].At.After(upTo); next++ {
			p := pubs[next]
			pending[p.Key] = append(pending[p.Key], pendingChange{p: p, idx: changeOf(p)})
			settle(p.Key, p.At)
		}
	}

	for i, ev := range e.Events {
		activate(ev.At)
		switch ev.Kind {
		case envoy.Opened:
			clear(seen)
			lastNonce, numeric = 0, true
		case envoy.Received:
			// One violation per response: reused, else out of order (the
			// relay's nonces are a counter per stream; others need only be
			// unique).
			n, err := strconv.ParseUint(ev.Nonce, 10, 64)
			numeric = numeric && err == nil
			if prev, dup := seen[ev.Nonce]; dup {
				violate(RuleNonce, i, ev.At, "nonce %q on %s was already used on this stream (by %s)", ev.Nonce, ev.TypeURL, prev)
			} else if numeric && n <= lastNonce {
				violate(RuleNonce, i, ev.At, "nonce %d on %s after nonce %d on the same stream", n, ev.TypeURL, lastNonce)
			}
			seen[ev.Nonce] = ev.TypeURL
			if numeric {
				lastNonce = max(lastNonce, n)
			}
			for j, name := range ev.Names {
				if j >= len(ev.Generations) || ev.Generations[j] == 0 {
					continue
				}
				key, g := traffic.ResourceKeyOf(ev.TypeURL, name), ev.Generations[j]
				if g < maxGen[key] {
					violate(RuleRegression, i, ev.At, "%s arrived with generation %d after generation %d (from %s, nonce %s)",
						key, g, maxGen[key], ev.ControlPlane, ev.Nonce)
				}
				maxGen[key] = max(maxGen[key], g)
			}
		case envoy.ACKed, envoy.NACKed:
			if t, ok := seen[ev.Nonce]; !ok || t != ev.TypeURL {
				violate(RuleNonce, i, ev.At, "%s of nonce %q on %s, which this stream did not receive for that type", ev.Kind, ev.Nonce, ev.TypeURL)
			}
			if ev.Kind == envoy.NACKed {
				break
			}
			for j, name := range ev.Names {
				key := traffic.ResourceKeyOf(ev.TypeURL, name)
				var g uint64
				if j < len(ev.Generations) {
					g = ev.Generations[j]
				}
				held[key] = heldRes{gen: g}
				settle(key, ev.At)
			}
		case envoy.Removed:
			for _, name := range ev.Names {
				key := traffic.ResourceKeyOf(ev.TypeURL, name)
				if gen, ok := tl.served(key, ev.At); ok {
					violate(RuleRemoval, i, ev.At, "%s removed while the upstream serves it (generation %d) to %s", key, gen, e.Group)
				}
				delete(held, key)
				settle(key, ev.At)
			}
		case envoy.Declared:
			// What the Envoy holds of the type, told the server on a new
			// stream: the record of truth from here on.
			prefix := ev.TypeURL + "|"
			for key := range held {
				if strings.HasPrefix(key, prefix) {
					delete(held, key)
				}
			}
			for j, name := range ev.Names {
				var g uint64
				if j < len(ev.Generations) {
					g = ev.Generations[j]
				}
				held[traffic.ResourceKeyOf(ev.TypeURL, name)] = heldRes{gen: g}
			}
			for key := range pending {
				if strings.HasPrefix(key, prefix) {
					settle(key, ev.At)
				}
			}
		}
	}
	activate(end)
	for _, key := range slices.Sorted(maps.Keys(pending)) {
		for _, pc := range pending[key] {
			violate(RuleUndeliver, -1, end, "%s generation %d (removed %v) published %s never reached it",
				key, pc.p.Generation, pc.p.Removed, pc.p.At.Format("15:04:05.000"))
		}
	}
	want := tl.final()
	var diffs []string
	for _, key := range slices.Sorted(maps.Keys(want)) {
		if h, ok := held[key]; !ok {
			diffs = append(diffs, fmt.Sprintf("%s missing", key))
		} else if h.gen != want[key] {
			diffs = append(diffs, fmt.Sprintf("%s at generation %d, want %d", key, h.gen, want[key]))
		}
	}
	for _, key := range slices.Sorted(maps.Keys(held)) {
		if _, ok := want[key]; !ok {
			diffs = append(diffs, fmt.Sprintf("%s held, not served", key))
		}
	}
	if len(diffs) > 0 {
		violate(RuleEndState, len(e.Events)-1, end, "%d differences from what %s is served, first: %s", len(diffs), e.Group, strings.Join(diffs[:min(3, len(diffs))], "; "))
	}
	return out
}
