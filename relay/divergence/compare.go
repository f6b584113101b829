package divergence

// A check's stream compared with the key's views by content.

import (
	"maps"
	"slices"
	"time"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/relay/adsclient"
	"github.com/meshrelay/meshrelay/relay/views"
	"github.com/meshrelay/meshrelay/relay/wire"
	"github.com/meshrelay/meshrelay/relay/xds"
)

// difference is one resource the check's stream and the key's view
// disagree on: held by one of them only (whatever its content there, so
// that the difference stays the same while that content changes), or by
// both with other content (the two hashes).
type difference struct {
	typeURL, name           string
	onlyInView, onlyInCheck bool
	got, view               ledger.Hash
}

// settled updates seen, the first sighting of each difference, to diffs
// (forgetting those gone) and returns the types of those seen for
// settle, in push order.
func settled(seen map[difference]time.Time, diffs []difference, now time.Time, settle time.Duration) []string {
	now0 := make(map[difference]bool, len(diffs))
	var types []string
	for _, d := range diffs {
		now0[d] = true
		at, ok := seen[d]
		if !ok {
			seen[d] = now
			continue
		}
		if now.Sub(at) >= settle && !slices.Contains(types, d.typeURL) {
			types = append(types, d.typeURL)
		}
	}
	maps.DeleteFunc(seen, func(d difference, _ time.Time) bool { return !now0[d] })
	slices.SortFunc(types, func(a, b string) int { return slices.Index(xds.PushOrder, a) - slices.Index(xds.PushOrder, b) })
	return types
}

// askedOf returns what a check asks for, by type, given what the key's
// members subscribe to (wanted: by type, whether any asks for everything):
// everything for those types, else the names the key's view holds (the
// members' and the names they point at). Nil until the views answer every
// type the members subscribe to, from the key's upstream, and whole where
// asked whole: a check that compared part of the key's config would miss
// what differs in the rest (an inbound listener, before the key's
// listeners arrived).
func askedOf(v *views.Set, wanted map[string]bool) map[string]xds.NameSet {
	if !Comparable(v, wanted) {
		return nil
	}
	asked := make(map[string]xds.NameSet)
	for typeURL, wildcard := range wanted {
		if !xds.Cached(typeURL) {
			continue
		}
		tv := v.Types[typeURL]
		if wildcard {
			asked[typeURL] = nil
			continue
		}
		names := make([]string, 0, tv.View.Len())
		for e := range tv.View.All() {
			names = append(names, e.Name)
		}
		if len(names) > 0 {
			asked[typeURL] = xds.NewNameSet(names)
		}
	}
	return asked
}

// Comparable reports whether v, a key's views, answers from the key's
// upstream every type in wanted (what its members subscribe to, by type,
// whether whole), and whole where wanted whole (see askedOf), and holds
// something to compare: until then a check of the key would compare
// part of its config, and miss what differs in the rest.
func Comparable(v *views.Set, wanted map[string]bool) bool {
	if v.Stale || v.Restored {
		return false
	}
	any := false
	for typeURL, wildcard := range wanted {
		if !xds.Cached(typeURL) {
			continue
		}
		tv := v.Types[typeURL]
		if tv == nil || !tv.Ready || wildcard && !tv.Full {
			return false
		}
		any = any || wildcard || tv.View.Len() > 0
	}
	return any
}

// probeStream is what a check's upstream stream asked and what it got.
// The check's goroutine alone uses it.
type probeStream struct {
	store *xds.Store
	asked map[string]xds.NameSet
	got   map[string]map[string]ledger.Hash // by type, then name
}

// handle enters a response of the check's stream, if of a type it asked.
func (p *probeStream) handle(m adsclient.Response) error {
	typeURL := m.GetTypeUrl()
	if _, ok := p.asked[typeURL]; !ok {
		return nil
	}
	switch m := m.(type) {
	case *wire.SotWIn:
		got, err := p.decode(typeURL, len(m.Resources), func(i int) *wire.AnyIn { return m.Resources[i] })
		if err != nil {
			return err
		}
		p.apply(typeURL, got, nil, xds.FullStateSotW(typeURL))
	case *wire.DeltaIn:
		res := slices.DeleteFunc(m.Resources, func(r wire.ResourceIn) bool { return r.Body == nil })
		got, err := p.decode(typeURL, len(res), func(i int) *wire.AnyIn { return res[i].Body })
		if err != nil {
			return err
		}
		p.apply(typeURL, got, m.RemovedResources, false)
	}
	return nil
}

// types returns the asked types in push order.
func (p *probeStream) types() []string {
	return slices.DeleteFunc(slices.Clone(xds.PushOrder), func(t string) bool {
		_, ok := p.asked[t]
		return !ok
	})
}

// decode hashes n bodies as the relay's views do (decoding only content
// the relay lacks) and keeps the asked ones.
func (p *probeStream) decode(typeURL string, n int, body func(int) *wire.AnyIn) (map[string]ledger.Hash, error) {
	names := p.asked[typeURL]
	out := make(map[string]ledger.Hash, n)
	for i := range n {
		res, err := p.store.Decode(typeURL, body(i), "")
		if err != nil {
			return nil, err
		}
		if names == nil || names.Has(res.Name) {
			out[res.Name] = res.Hash
		}
	}
	return out, nil
}

// apply enters a response: a whole type's content (replace), or changes.
func (p *probeStream) apply(typeURL string, upd map[string]ledger.Hash, removed []string, replace bool) {
	cur := p.got[typeURL]
	if replace || cur == nil {
		cur = make(map[string]ledger.Hash, len(upd))
		p.got[typeURL] = cur
	}
	maps.Copy(cur, upd)
	for _, n := range removed {
		delete(cur, n)
	}
}

// compare compares what the check got with v: ok once every asked type
// answered, and v holds the whole of every type asked whole; then the
// differences. A resource one side lacks is a difference whatever the
// other's content, so that it stays the same while that content changes.
func (p *probeStream) compare(v *views.Set) (diffs []difference, ok bool) {
	for _, typeURL := range p.types() {
		got, answered := p.got[typeURL]
		if !answered {
			return nil, false
		}
		tv := v.Types[typeURL]
		if tv == nil {
			continue // the key no longer asks for it
		}
		note := func(name string, got ledger.Hash, inGot bool, view ledger.Hash, inView bool) {
			d := difference{typeURL: typeURL, name: name, onlyInView: !inGot, onlyInCheck: !inView}
			if inGot && inView {
				d.got, d.view = got, view
			}
			diffs = append(diffs, d)
		}
		names := p.asked[typeURL]
		if names == nil {
			if !tv.Full {
				return nil, false // the key's view is being filled
			}
			for e := range tv.View.All() {
				if h, ok := got[e.Name]; !ok || h != e.Hash {
					note(e.Name, h, ok, e.Hash, true)
				}
			}
			for name, h := range got {
				if _, ok := tv.View.Get(name); !ok {
					note(name, h, true, ledger.Hash{}, false)
				}
			}
			continue
		}
		// Names asked by name are compared where both hold them: a
		// difference must be in what the upstream gives both nodes. A
		// name only the key's view holds proves nothing: a SotW
		// upstream never tells a stream that asks for a name by name
		// that it is gone, so the view keeps a removed service's
		// endpoints while anyone asks for them (a relay frozen for a
		// while, which cannot pass its Envoys' unsubscriptions on, did:
		// issue 28 saw keys split for it), and the check's stream is
		// told nothing of them.
		for _, name := range names {
			e, inView := tv.View.Get(name)
			if !inView {
				continue
			}
			if h, inGot := got[name]; inGot && h != e.Hash {
				note(name, h, true, e.Hash, true)
			}
		}
	}
	return diffs, true
}
