package ledgerpb

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/meshrelay/meshrelay/ledger"
)

// ErrBadMessage is returned for a message that does not decode into the
// ledger's types: another relay's answer is checked, not trusted.
var ErrBadMessage = errors.New("ledgerpb: bad message")

func nanos(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func fromNanos(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

func hashBytes(h ledger.Hash) []byte {
	if h.IsZero() {
		return nil
	}
	return h[:]
}

func toHash(b []byte, what string) (ledger.Hash, error) {
	var h ledger.Hash
	switch len(b) {
	case 0:
		return h, nil
	case len(h):
		copy(h[:], b)
		return h, nil
	}
	return h, fmt.Errorf("%w: %s is %d bytes, want %d", ErrBadMessage, what, len(b), len(h))
}

// FromScope encodes a Scope.
func FromScope(s ledger.Scope) *Scope { return &Scope{Key: s.Key, KeyPrefix: s.KeyPrefix} }

// ToScope decodes a Scope (nil is every Envoy).
func ToScope(s *Scope) ledger.Scope {
	return ledger.Scope{Key: s.GetKey(), KeyPrefix: s.GetKeyPrefix()}
}

// FromSummary encodes a Summary.
func FromSummary(s *ledger.Summary) *Summary {
	out := &Summary{Relay: s.Relay, At: nanos(s.At), Keys: make([]*KeySummary, len(s.Keys))}
	for i := range s.Keys {
		out.Keys[i] = fromKey(&s.Keys[i])
	}
	return out
}

func fromKey(k *ledger.KeySummary) *KeySummary {
	pk := &KeySummary{Key: k.Key, Source: string(k.Source), Stale: k.Stale, Splits: k.Splits, Types: make([]*TypeVersion, len(k.Types))}
	for j, tv := range k.Types {
		v := tv.Version
		pk.Types[j] = &TypeVersion{Type: tv.Type, Version: &Version{Seq: v.Seq, Root: hashBytes(v.Root), Received: nanos(v.Received), Len: int64(v.Len)}}
	}
	typeIdx := map[string]uint64{}
	typeIndex := func(typeURL string) uint64 {
		ti, ok := typeIdx[typeURL]
		if !ok {
			ti = uint64(len(pk.TypeUrls))
			pk.TypeUrls = append(pk.TypeUrls, typeURL)
			typeIdx[typeURL] = ti
		}
		return ti
	}
	rootIdx := map[ledger.Hash]uint64{{}: 0}
	root := func(h ledger.Hash) uint64 {
		i, ok := rootIdx[h]
		if !ok {
			pk.Roots = append(pk.Roots, append([]byte(nil), h[:]...))
			i = uint64(len(pk.Roots))
			rootIdx[h] = i
		}
		return i
	}
	// sets holds an Envoy of each type set given so far, by index.
	var sets [][]ledger.EnvoyType
	set := func(types []ledger.EnvoyType) int {
	next:
		for i, ts := range sets {
			if len(ts) != len(types) {
				continue
			}
			for j := range ts {
				if ts[j].Type != types[j].Type {
					continue next
				}
			}
			return i
		}
		s := &TypeSet{Types: make([]uint32, len(types))}
		for j, et := range types {
			s.Types[j] = uint32(typeIndex(et.Type))
		}
		pk.TypeSets = append(pk.TypeSets, s)
		sets = append(sets, types)
		return len(sets) - 1
	}
	// Each Envoy's type set if it goes in brief (-1: in full), and the
	// room each form needs. A Brief summary's settled Envoys of a type set
	// share their Types: one with the last one's needs no check.
	setOf := make([]int, len(k.Envoys))
	briefSize, fullSize := 0, 0
	var lastTypes []ledger.EnvoyType
	lastSet := -1
	for j := range k.Envoys {
		e := &k.Envoys[j]
		setOf[j] = -1
		if len(e.Types) > 0 && e.Connected() && (sameSlice(e.Types, lastTypes) || inBrief(k, e)) {
			if !sameSlice(e.Types, lastTypes) {
				lastTypes, lastSet = e.Types, set(e.Types)
			}
			setOf[j] = lastSet
			briefSize += len(e.Node) + 3 + binary.MaxVarintLen64
		} else {
			fullSize += len(e.Node) + 4 + 2*binary.MaxVarintLen64 + len(e.Types)*(4+4*binary.MaxVarintLen64)
		}
	}
	brief, b := make([]byte, 0, briefSize), make([]byte, 0, fullSize)
	metas := newMetaTable(pk, k.Envoys)
	for j := range k.Envoys {
		e := &k.Envoys[j]
		metas.add(e.Meta, setOf[j] >= 0)
		if setOf[j] >= 0 {
			brief = binary.AppendUvarint(brief, uint64(len(e.Node)))
			brief = append(brief, e.Node...)
			brief = binary.AppendUvarint(brief, uint64(nanos(e.ConnectedAt)))
			brief = binary.AppendUvarint(brief, uint64(setOf[j]))
			pk.BriefCount++
			continue
		}
		pk.EnvoyCount++
		b = binary.AppendUvarint(b, uint64(len(e.Node)))
		b = append(b, e.Node...)
		b = binary.AppendUvarint(b, uint64(nanos(e.ConnectedAt)))
		b = binary.AppendUvarint(b, uint64(nanos(e.DisconnectedAt)))
		b = binary.AppendUvarint(b, uint64(len(e.Types)))
		for _, et := range e.Types {
			var flags byte
			if et.Pending {
				flags |= flagPending
			}
			if et.NACK != nil {
				flags |= flagNACK
			}
			b = binary.AppendUvarint(b, typeIndex(et.Type))
			b = append(b, flags)
			b = binary.AppendUvarint(b, root(et.Sent))
			b = binary.AppendUvarint(b, uint64(nanos(et.SentAt)))
			b = binary.AppendUvarint(b, root(et.Acked))
			b = binary.AppendUvarint(b, uint64(nanos(et.AckedAt)))
			if et.NACK != nil {
				b = binary.AppendUvarint(b, uint64(len(pk.Nacks)))
				pk.Nacks = append(pk.Nacks, fromNACK(et.NACK))
			}
		}
	}
	pk.Envoys, pk.BriefEnvoys = b, brief
	pk.NodeMetas = metas.bytes()
	return pk
}

// metaTable builds a KeySummary's node metadata: the table of distinct
// entries and each Envoy's index, full ones first, then brief ones, as
// the decoder reads the Envoys. Nil (and nothing sent) when no Envoy has
// any.
type metaTable struct {
	pk          *KeySummary
	idx         map[ledger.NodeMeta]uint64
	full, brief []byte
}

func newMetaTable(pk *KeySummary, envoys []ledger.EnvoyState) *metaTable {
	for j := range envoys {
		if envoys[j].Meta != (ledger.NodeMeta{}) {
			return &metaTable{pk: pk, idx: map[ledger.NodeMeta]uint64{{}: 0}}
		}
	}
	return nil
}

func (t *metaTable) add(m ledger.NodeMeta, brief bool) {
	if t == nil {
		return
	}
	i, ok := t.idx[m]
	if !ok {
		t.pk.Metas = append(t.pk.Metas, &NodeMeta{Namespace: m.Namespace, Cluster: m.Cluster, Version: m.Version})
		i = uint64(len(t.pk.Metas))
		t.idx[m] = i
	}
	if brief {
		t.brief = binary.AppendUvarint(t.brief, i)
	} else {
		t.full = binary.AppendUvarint(t.full, i)
	}
}

func (t *metaTable) bytes() []byte {
	if t == nil {
		return nil
	}
	return append(t.full, t.brief...)
}

// decodeMetas sets each Envoy's Meta from pk's node metadata (none if
// absent): one entry per Envoy, full then brief, as envoys holds them.
func decodeMetas(pk *KeySummary, envoys []ledger.EnvoyState) error {
	data := pk.GetNodeMetas()
	if len(data) == 0 {
		return nil
	}
	table := make([]ledger.NodeMeta, len(pk.GetMetas())+1)
	for i, m := range pk.GetMetas() {
		table[i+1] = ledger.NodeMeta{Namespace: m.GetNamespace(), Cluster: m.GetCluster(), Version: m.GetVersion()}
	}
	d := decoder{b: data}
	for j := range envoys {
		i := d.uvarint()
		if d.err == nil && i >= uint64(len(table)) {
			d.fail("a node metadata index")
		}
		if d.err != nil {
			return d.err
		}
		envoys[j].Meta = table[i]
	}
	if len(d.b) != 0 {
		return fmt.Errorf("%w: %d bytes after the last Envoy's node metadata", ErrBadMessage, len(d.b))
	}
	return nil
}

// sameSlice reports whether a and b are one slice: same array, same
// length (not merely equal elements).
func sameSlice(a, b []ledger.EnvoyType) bool { return len(a) == len(b) && len(a) > 0 && &a[0] == &b[0] }

// inBrief reports whether e's record loses nothing in brief: connected,
// sent and ACKed k's current root of every type it holds, at no time given
// (as a ledger.Brief summary gives it), nothing pending and no NACK.
func inBrief(k *ledger.KeySummary, e *ledger.EnvoyState) bool {
	if !e.Connected() || len(e.Types) == 0 {
		return false
	}
	for _, et := range e.Types {
		if et.Pending || et.NACK != nil || !et.SentAt.IsZero() || !et.AckedAt.IsZero() || et.Sent != et.Acked || et.Acked.IsZero() {
			return false
		}
		if cur, ok := currentRoot(k.Types, et.Type); !ok || cur != et.Acked {
			return false
		}
	}
	return true
}

func currentRoot(types []ledger.TypeVersion, typeURL string) (ledger.Hash, bool) {
	for _, tv := range types {
		if tv.Type == typeURL {
			return tv.Version.Root, true
		}
	}
	return ledger.Hash{}, false
}

const (
	flagPending = 1 << iota
	flagNACK
)

func fromNACK(n *ledger.NACKState) *NACK {
	if n == nil {
		return nil
	}
	return &NACK{Fingerprint: string(n.Fingerprint), Version: n.Version, Detail: n.Detail, At: nanos(n.At)}
}

func toNACK(n *NACK) *ledger.NACKState {
	if n == nil {
		return nil
	}
	return &ledger.NACKState{Fingerprint: ledger.Fingerprint(n.Fingerprint), Version: n.Version, Detail: n.Detail, At: fromNanos(n.At)}
}

// ToSummary decodes a Summary, checking every hash, index and length.
func ToSummary(p *Summary) (*ledger.Summary, error) {
	out := &ledger.Summary{Relay: p.GetRelay(), At: fromNanos(p.GetAt()), Keys: make([]ledger.KeySummary, len(p.GetKeys()))}
	for i, pk := range p.GetKeys() {
		k, err := toKey(pk, out.Relay)
		if err != nil {
			return nil, fmt.Errorf("key %q: %w", pk.GetKey(), err)
		}
		out.Keys[i] = k
	}
	return out, nil
}

// maxSplits bounds the splits a relay may describe for one key (the relay
// keeps 32 at most: aggkey.MaxSplits).
const maxSplits = 64

// minEnvoyRecord, minTypeRecord and minBriefRecord are the fewest bytes an
// Envoy's record, one of its types and an Envoy's record in brief take.
const minEnvoyRecord, minTypeRecord, minBriefRecord = 5, 6, 3

func toKey(pk *KeySummary, relay string) (ledger.KeySummary, error) {
	k := ledger.KeySummary{Key: pk.GetKey(), Relay: relay, Source: ledger.Source(pk.GetSource()), Stale: pk.GetStale(),
		Splits: pk.GetSplits(), Types: make([]ledger.TypeVersion, len(pk.GetTypes()))}
	if len(k.Splits) > maxSplits {
		return k, fmt.Errorf("%w: %d splits of a key", ErrBadMessage, len(k.Splits))
	}
	for j, tv := range pk.GetTypes() {
		v := tv.GetVersion()
		root, err := toHash(v.GetRoot(), "a root")
		if err != nil {
			return k, err
		}
		if v.GetLen() < 0 {
			return k, fmt.Errorf("%w: %d resources", ErrBadMessage, v.GetLen())
		}
		k.Types[j] = ledger.TypeVersion{Type: tv.GetType(), Version: ledger.Version{Seq: v.GetSeq(), Root: root, Received: fromNanos(v.GetReceived()), Len: int(v.GetLen())}}
	}
	roots := make([]ledger.Hash, 1, len(pk.GetRoots())+1)
	for _, b := range pk.GetRoots() {
		h, err := ledger.HashFromBytes(b)
		if err != nil {
			return k, fmt.Errorf("%w: a root of %d bytes", ErrBadMessage, len(b))
		}
		roots = append(roots, h)
	}
	nacks := make([]*ledger.NACKState, len(pk.GetNacks()))
	for i, n := range pk.GetNacks() {
		nacks[i] = toNACK(n)
	}
	data, briefData := pk.GetEnvoys(), pk.GetBriefEnvoys()
	n, nb := int(pk.GetEnvoyCount()), int(pk.GetBriefCount())
	if n > len(data)/minEnvoyRecord || nb > len(briefData)/minBriefRecord {
		return k, fmt.Errorf("%w: %d Envoys in %d bytes and %d in brief in %d", ErrBadMessage, n, len(data), nb, len(briefData))
	}
	k.Envoys = make([]ledger.EnvoyState, n+nb)
	if err := decodeBrief(&k, pk, k.Envoys[n:]); err != nil {
		return k, err
	}
	// Node names share one string: a record's name is a slice of it.
	str := string(data)
	d := decoder{b: data}
	var types []ledger.EnvoyType
	for j := range n {
		e := &k.Envoys[j]
		l := d.uvarint()
		if d.err == nil && l > uint64(len(d.b)) {
			d.fail("a node name")
		}
		if d.err != nil {
			return k, d.err
		}
		start := len(data) - len(d.b)
		e.Node = str[start : start+int(l)]
		d.b = d.b[l:]
		e.ConnectedAt = fromNanos(int64(d.uvarint()))
		e.DisconnectedAt = fromNanos(int64(d.uvarint()))
		nt := d.uvarint()
		if d.err == nil && (nt > uint64(len(pk.GetTypeUrls())) || nt > uint64(len(d.b)/minTypeRecord)) {
			d.fail("a count of types")
		}
		if d.err != nil {
			return k, d.err
		}
		if cap(types)-len(types) < int(nt) {
			// Room for this Envoy and, at as many types, the rest (no more
			// than the bytes left can hold).
			types = make([]ledger.EnvoyType, 0, min(int(nt)*(n-j), len(d.b)/minTypeRecord))
		}
		first := len(types)
		for range nt {
			var et ledger.EnvoyType
			et.Type = d.index(pk.GetTypeUrls(), "a type")
			flags := d.byte()
			et.Pending = flags&flagPending != 0
			et.Sent = d.root(roots)
			et.SentAt = fromNanos(int64(d.uvarint()))
			et.Acked = d.root(roots)
			et.AckedAt = fromNanos(int64(d.uvarint()))
			if flags&flagNACK != 0 {
				if i := d.uvarint(); d.err == nil {
					if i >= uint64(len(nacks)) {
						d.fail("a NACK index")
					} else {
						et.NACK = nacks[i]
					}
				}
			}
			if flags&^(flagPending|flagNACK) != 0 {
				d.fail("flags")
			}
			if d.err != nil {
				return k, d.err
			}
			types = append(types, et)
		}
		e.Types = types[first:len(types):len(types)]
	}
	if len(d.b) != 0 {
		return k, fmt.Errorf("%w: %d bytes after the last Envoy", ErrBadMessage, len(d.b))
	}
	return k, decodeMetas(pk, k.Envoys)
}

// decodeBrief decodes the Envoys pk gives in brief into out (as many as
// pk.BriefCount), those of one type set sharing their Types. k's Types
// must be decoded: they hold the roots.
func decodeBrief(k *ledger.KeySummary, pk *KeySummary, out []ledger.EnvoyState) error {
	sets := make([][]ledger.EnvoyType, len(pk.GetTypeSets()))
	for i, s := range pk.GetTypeSets() {
		if len(s.GetTypes()) == 0 || len(s.GetTypes()) > len(pk.GetTypeUrls()) {
			return fmt.Errorf("%w: a type set of %d types", ErrBadMessage, len(s.GetTypes()))
		}
		sets[i] = make([]ledger.EnvoyType, len(s.GetTypes()))
		for j, ti := range s.GetTypes() {
			if int(ti) >= len(pk.GetTypeUrls()) {
				return fmt.Errorf("%w: bad type index in a type set", ErrBadMessage)
			}
			typeURL := pk.GetTypeUrls()[ti]
			root, ok := currentRoot(k.Types, typeURL)
			if !ok || root.IsZero() {
				return fmt.Errorf("%w: a type set names %s, which the key has no version of", ErrBadMessage, typeURL)
			}
			sets[i][j] = ledger.EnvoyType{Type: typeURL, Sent: root, Acked: root}
		}
	}
	data := pk.GetBriefEnvoys()
	str := string(data)
	d := decoder{b: data}
	for j := range out {
		e := &out[j]
		l := d.uvarint()
		if d.err == nil && l > uint64(len(d.b)) {
			d.fail("a node name")
		}
		if d.err != nil {
			return d.err
		}
		start := len(data) - len(d.b)
		e.Node = str[start : start+int(l)]
		d.b = d.b[l:]
		e.ConnectedAt = fromNanos(int64(d.uvarint()))
		if i := d.uvarint(); d.err == nil {
			if i >= uint64(len(sets)) {
				d.fail("type set index")
			} else {
				e.Types = sets[i]
			}
		}
		if d.err != nil {
			return d.err
		}
	}
	if len(d.b) != 0 {
		return fmt.Errorf("%w: %d bytes after the last Envoy in brief", ErrBadMessage, len(d.b))
	}
	return nil
}

// decoder reads a packed record; the first error sticks.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: bad %s", ErrBadMessage, what)
	}
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail("varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) byte() byte {
	if d.err != nil {
		return 0
	}
	if len(d.b) == 0 {
		d.fail("record: truncated")
		return 0
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c
}

func (d *decoder) index(table []string, what string) string {
	i := d.uvarint()
	if d.err != nil {
		return ""
	}
	if i >= uint64(len(table)) {
		d.fail(what + " index")
		return ""
	}
	return table[i]
}

func (d *decoder) root(roots []ledger.Hash) ledger.Hash {
	i := d.uvarint()
	if d.err != nil {
		return ledger.Hash{}
	}
	if i >= uint64(len(roots)) {
		d.fail("root index")
		return ledger.Hash{}
	}
	return roots[i]
}

// FromVerdicts encodes a relay's delivery verdicts.
func FromVerdicts(vs []ledger.Verdicts) *DeliveryVerdicts {
	out := &DeliveryVerdicts{Keys: make([]*KeyVerdicts, len(vs))}
	for i, v := range vs {
		pk := &KeyVerdicts{Key: v.Key, References: v.References, Known: v.Known}
		for root, has := range v.Roots {
			b := append([]byte(nil), root[:]...)
			if has {
				pk.Delivered = append(pk.Delivered, b)
			} else {
				pk.NotDelivered = append(pk.NotDelivered, b)
			}
		}
		out.Keys[i] = pk
	}
	return out
}

// ToVerdicts decodes a relay's delivery verdicts, checking every root.
func ToVerdicts(p *DeliveryVerdicts) ([]ledger.Verdicts, error) {
	out := make([]ledger.Verdicts, len(p.GetKeys()))
	for i, pk := range p.GetKeys() {
		v := ledger.Verdicts{Key: pk.GetKey(), References: pk.GetReferences(), Known: pk.GetKnown(),
			Roots: make(map[ledger.Hash]bool, len(pk.GetDelivered())+len(pk.GetNotDelivered()))}
		for _, set := range []struct {
			roots [][]byte
			has   bool
		}{{pk.GetNotDelivered(), false}, {pk.GetDelivered(), true}} {
			for _, b := range set.roots {
				h, err := toHash(b, "a root")
				if err != nil {
					return nil, err
				}
				v.Roots[h] = v.Roots[h] || set.has
			}
		}
		out[i] = v
	}
	return out, nil
}
