package ledger

import (
	"errors"
	"fmt"
	"time"
)

// Delivery answers "has typeURL/name at hash, or a later content of it,
// reached every Envoy whose view references it?". Only keys whose current
// view holds name count: their Envoys should hold it.
type Delivery struct {
	Type, Name string
	Hash       Hash
	Keys       []DeliveryKey // by Key
}

// DeliveryKey is the answer for the Envoys of one key.
type DeliveryKey struct {
	Key string
	// Known is set if some relay's history of the key holds name at Hash.
	// If none does, the content is older than the history kept, or no
	// relay has received it yet, and no Envoy counts as delivered.
	Known     bool
	Envoys    int
	Delivered int
	Missing   []Straggler
}

// Done reports whether every Envoy that should hold the content does (and
// some relay knew the content).
func (d *Delivery) Done() bool {
	envoys, delivered, known := d.Counts()
	return known && envoys == delivered
}

// Counts returns the Envoys that should hold the content, those that do,
// and whether every key's history knew it.
func (d *Delivery) Counts() (envoys, delivered int, known bool) {
	known = len(d.Keys) > 0
	for _, k := range d.Keys {
		envoys += k.Envoys
		delivered += k.Delivered
		known = known && k.Known
	}
	return envoys, delivered, known
}

// Verdicts is one relay's judgement, for one key, of whether the roots its
// Envoys ACKed hold a resource's content (or a later one): the few distinct
// roots, each checked by a Merkle proof against the key's history, stand
// for every Envoy that ACKed them.
type Verdicts struct {
	Key string
	// References is set if the relay's current view of the key holds the
	// name. Known is set if its history holds the name at the hash.
	References, Known bool
	// Roots holds, for each distinct root the relay's Envoys ACKed, whether
	// that version holds the content or a later one.
	Roots map[Hash]bool
}

// Verdicts judges, for every key of scope, the roots this relay's Envoys
// ACKed of typeURL against name at hash: it proves what each of those few
// roots holds of name from the key's history, and checks each proof. No
// per-Envoy resource lists are kept or read.
func (t *Tracker) Verdicts(scope Scope, typeURL, name string, hash Hash) ([]Verdicts, error) {
	if hash.IsZero() {
		return nil, fmt.Errorf("ledger: delivery of %s %q: no content hash", typeURL, name)
	}
	var out []Verdicts
	for _, k := range t.keysIn(scope) {
		k.mu.Lock()
		var views Views
		var cur Version
		if te := k.types[typeURL]; te != nil {
			views, cur = te.views, te.current
		}
		roots := map[Hash]bool{}
		for _, e := range k.envoys {
			for _, et := range e.types {
				if et.typeURL == typeURL {
					roots[et.ackedView] = false
				}
			}
		}
		k.mu.Unlock()
		if views == nil {
			continue
		}
		v := Verdicts{Key: k.key, Roots: roots}
		_, refs, err := proveAt(views, cur.Root, name)
		if errors.Is(err, ErrUnknownVersion) {
			continue // the view moved on and the version expired: ask again
		}
		if err != nil {
			return nil, fmt.Errorf("key %s: %w", k.key, err)
		}
		v.References = refs
		first, known := views.FirstWith(name, hash)
		v.Known = known
		for root := range roots {
			ver, ok := views.Lookup(root)
			if !ok || !known || ver.Seq < first {
				continue
			}
			_, has, err := proveAt(views, root, name)
			if errors.Is(err, ErrUnknownVersion) {
				continue // expired since Lookup: not known to hold it
			}
			if err != nil {
				return nil, fmt.Errorf("key %s: %w", k.key, err)
			}
			roots[root] = has
		}
		out = append(out, v)
	}
	return out, nil
}

// Delivery answers for this relay's Envoys.
func (t *Tracker) Delivery(scope Scope, typeURL, name string, hash Hash, now time.Time) (*Delivery, error) {
	vs, err := t.Verdicts(scope, typeURL, name, hash)
	if err != nil {
		return nil, err
	}
	return Merge(t.Summary(scope, now, Brief)).Delivery(typeURL, name, hash, vs), nil
}

// Delivery answers for the report's Envoys (each counted once, where it is
// connected) from the verdicts of the relays that serve them.
func (r *Report) Delivery(typeURL, name string, hash Hash, verdicts []Verdicts) *Delivery {
	type keyVerdict struct {
		refs, known bool
		roots       map[Hash]bool
	}
	byKey := map[string]*keyVerdict{}
	for _, v := range verdicts {
		kv := byKey[v.Key]
		if kv == nil {
			kv = &keyVerdict{roots: map[Hash]bool{}}
			byKey[v.Key] = kv
		}
		kv.refs = kv.refs || v.References
		kv.known = kv.known || v.Known
		for root, has := range v.Roots {
			// A root is content: a relay that proved it holds the content
			// is right for every relay (another may lack the history).
			kv.roots[root] = kv.roots[root] || has
		}
	}
	out := &Delivery{Type: typeURL, Name: name, Hash: hash}
	for _, key := range r.order {
		kv := byKey[key]
		if kv == nil || !kv.refs {
			continue
		}
		rk := r.keys[key]
		dk := DeliveryKey{Key: key, Known: kv.known}
		for _, e := range rk.envoys {
			var acked Hash
			for _, et := range e.state.Types {
				if et.Type == typeURL {
					acked = et.Acked
				}
			}
			dk.Envoys++
			if kv.roots[acked] {
				dk.Delivered++
				continue
			}
			s := e.behind
			if s == nil {
				// On its key's current version, which its relay has not
				// proved holds the content: that relay is behind.
				s = &Straggler{Node: e.state.Node, Key: key, Relay: e.from.Relay, Type: typeURL, Reason: StaleSource, Since: e.state.ConnectedAt}
			}
			dk.Missing = append(dk.Missing, *s)
		}
		sortByNode(dk.Missing)
		out.Keys = append(out.Keys, dk)
	}
	return out
}

// proveAt returns what root holds of name, proved and checked.
func proveAt(views Views, root Hash, name string) (Hash, bool, error) {
	p, err := views.Prove(root, name)
	if err != nil {
		return Hash{}, false, err
	}
	return p.Verify(root)
}
