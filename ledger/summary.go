package ledger

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Summary is one relay's ledger at one moment: every key it holds with the
// key's current versions, and every Envoy it serves (or served, until
// forgotten) with what it was sent and ACKed. Summaries of every relay,
// merged, answer for the tier.
type Summary struct {
	Relay string
	At    time.Time
	Keys  []KeySummary // by Key
}

// Detail says how much a summary tells of the Envoys on their key's
// current version (98% of them on a settled tier).
type Detail int

const (
	// Full gives every Envoy's every type with its roots, times, pending
	// response and NACK: what proxy-status's full view and istioctl's
	// syncz show.
	Full Detail = iota
	// Brief gives an Envoy on its key's current version of every type it
	// holds, with nothing pending and no NACK, as its node, connection
	// time and types, each type's sent and ACKed root the key's current
	// one and no times; the other Envoys in full. It answers convergence,
	// stragglers and delivery as Full does, at a fraction of the cost of a
	// tier-wide gather (except a stale-source straggler's Since, which is
	// its connection time, not its last ACK). Envoys of one key may share
	// their Types: read them, never change them.
	Brief
)

// KeySummary is a relay's state of one key.
type KeySummary struct {
	Key   string
	Relay string
	// Source is where the relay gets the key from. A relay that holds the
	// key's upstream stream (SourceUpstream, SourceFallback) is an origin:
	// its versions are the key's reference. Stale is set while no live
	// source confirms them.
	Source Source
	Stale  bool
	// Splits describe the key's splits the relay knows: a divergence
	// check found members the upstream gives other config, which moved
	// to keys of their own with their look-alikes. Read, never change.
	Splits []string
	Types  []TypeVersion // by Type
	Envoys []EnvoyState  // in no order (a Report orders them)
}

// Source says where a relay gets a key's config from.
type Source string

// Sources.
const (
	// SourceUpstream: the relay owns the key and holds its upstream stream.
	SourceUpstream Source = "upstream"
	// SourceFallback: the relay holds an upstream stream for the key though
	// another owns it (the owner is unreachable).
	SourceFallback Source = "fallback"
	// SourcePeer: the relay gets the key from its owner.
	SourcePeer Source = "peer"
)

// Origin reports whether the relay holds the key's upstream stream.
func (k *KeySummary) Origin() bool { return k.Source == SourceUpstream || k.Source == SourceFallback }

// LedgerVersion is the key's ledger version: its types' roots combined.
func (k *KeySummary) LedgerVersion() Hash {
	pairs := make([]typeRoot, len(k.Types))
	for i, tv := range k.Types {
		pairs[i] = typeRoot{tv.Type, tv.Version.Root}
	}
	return combine(pairs)
}

// LedgerVersion is the ledger version the Envoy ACKed: the roots it ACKed
// of each type it subscribes to, combined. It equals its key's when it is
// on every type's current version and subscribes to every type the key has.
func (e *EnvoyState) LedgerVersion() Hash {
	pairs := make([]typeRoot, len(e.Types))
	for i, et := range e.Types {
		pairs[i] = typeRoot{et.Type, et.Acked}
	}
	return combine(pairs)
}

type typeRoot struct {
	typeURL string
	root    Hash
}

// combine hashes (type URL, root) pairs in type URL order: the same content
// gives the same version on every relay, whatever order it learned it in.
func combine(pairs []typeRoot) Hash {
	slices.SortFunc(pairs, func(a, b typeRoot) int { return strings.Compare(a.typeURL, b.typeURL) })
	h := sha256.New()
	h.Write([]byte("meshrelay.ledger.v1/key"))
	for _, p := range pairs {
		var n [binary.MaxVarintLen64]byte
		h.Write(n[:binary.PutUvarint(n[:], uint64(len(p.typeURL)))])
		h.Write([]byte(p.typeURL))
		h.Write(p.root[:])
	}
	var out Hash
	h.Sum(out[:0])
	return out
}

// TypeVersion is a key's current version of one type.
type TypeVersion struct {
	Type    string
	Version Version
}

// EnvoyState is what a relay knows of one Envoy.
type EnvoyState struct {
	Node           string
	Meta           NodeMeta
	ConnectedAt    time.Time
	DisconnectedAt time.Time   // zero while connected
	Types          []EnvoyType // in push order: CDS, EDS, LDS, RDS, then by name
}

// NodeMeta is what admin tools show of a node beside its id (istioctl's
// proxy-status columns and its namespace filter): its namespace, cluster
// and proxy version, as its metadata gave them ("" where it gave none).
type NodeMeta struct {
	Namespace, Cluster, Version string
}

// Connected reports whether the Envoy's stream is open.
func (e *EnvoyState) Connected() bool { return e.DisconnectedAt.IsZero() }

// EnvoyType is an Envoy's state of one type.
type EnvoyType struct {
	Type string
	// Sent is the view the Envoy holds all it should of once it applies
	// what it was sent (zero: not known yet); Pending is set while the
	// latest response is unanswered.
	Sent    Hash
	SentAt  time.Time
	Pending bool
	// Acked is the latest view the Envoy ACKed all it should of ("acked",
	// not "applied": an ACK says the config was valid, not that it serves).
	Acked   Hash
	AckedAt time.Time
	NACK    *NACKState
}

// NACKState is an Envoy's latest NACK of a type.
type NACKState struct {
	Fingerprint Fingerprint
	Version     string
	Detail      string
	At          time.Time
}

// Reason says why an Envoy is not on its key's current version.
type Reason string

// Straggler reasons, in the order they are checked.
const (
	// NotConnected: the Envoy's stream ended and it has not connected again.
	NotConnected Reason = "not connected"
	// NACKed: it rejected what it was sent (Straggler.NACK says how).
	NACKed Reason = "nacked"
	// NotACKed: it was sent the version and has not answered.
	NotACKed Reason = "sent, not acked"
	// StaleSource: its relay's source has not delivered the current version:
	// the relay's views are stale or behind the key's reference.
	StaleSource Reason = "stale source"
	// NotSent: none of the above; the relay has not sent it the version yet
	// (it is held back, say until the clusters a route uses arrive).
	NotSent Reason = "not sent"
)

// Straggler is an Envoy not on its key's current version, and why.
type Straggler struct {
	Node   string
	Key    string
	Relay  string
	Type   string // the first type, in push order, that is behind
	Reason Reason
	NACK   *NACKState // for NACKed
	// Since is when it fell behind as far as the relay can tell: the stream's
	// end, the NACK, the send, or the last ACK.
	Since time.Time
}

// Convergence counts Envoys on their key's current version.
type Convergence struct {
	Envoys  int
	Current int
}

// Share is Current / Envoys (1 when there are no Envoys).
func (c Convergence) Share() float64 {
	if c.Envoys == 0 {
		return 1
	}
	return float64(c.Current) / float64(c.Envoys)
}

func (c *Convergence) add(current bool) {
	c.Envoys++
	if current {
		c.Current++
	}
}

// nextForget returns when the first of the summary's disconnected Envoys is
// forgotten.
func (s *Summary) nextForget(after time.Duration) (time.Time, bool) {
	var first time.Time
	for i := range s.Keys {
		for j := range s.Keys[i].Envoys {
			if d := s.Keys[i].Envoys[j].DisconnectedAt; !d.IsZero() && (first.IsZero() || d.Before(first)) {
				first = d
			}
		}
	}
	return first.Add(after), !first.IsZero()
}

// Convergence returns the share of this summary's Envoys on their key's
// current version.
func (s *Summary) Convergence() Convergence { return Merge(s).Convergence() }

// Stragglers lists this summary's Envoys behind their key's current
// version (at most limit; 0 means all).
func (s *Summary) Stragglers(limit int) []Straggler { return Merge(s).Stragglers(limit) }

// Report is the ledger merged from one or more Summaries: the answers for a
// relay, or for the tier.
type Report struct {
	keys  map[string]*reportKey
	order []string
}

type reportKey struct {
	// reference is the key's current version of each type: from a fresh
	// relay at the origin if there is one, else the latest received.
	reference []typeRef
	// relays holds, by relay, its summary of the key.
	relays []*KeySummary
	envoys []reportEnvoy
}

type typeRef struct {
	typeURL string
	refVersion
}

type refVersion struct {
	Version
	origin, fresh bool
}

type reportEnvoy struct {
	state *EnvoyState
	from  *KeySummary
	// behind says why the Envoy is not on its key's reference version (nil:
	// it is); computed once by Merge.
	behind *Straggler
}

// Merge merges the summaries of several relays (or one). An Envoy listed by
// more than one relay (it moved) counts once, as its latest connection
// says.
func Merge(sums ...*Summary) *Report {
	r := &Report{keys: make(map[string]*reportKey)}
	// An Envoy is listed once per relay; only several relays can list it
	// twice.
	var latest map[string]*EnvoyState // by node
	if len(sums) > 1 {
		total := 0
		for _, s := range sums {
			for i := range s.Keys {
				total += len(s.Keys[i].Envoys)
			}
		}
		latest = make(map[string]*EnvoyState, total)
		for _, s := range sums {
			for i := range s.Keys {
				for j := range s.Keys[i].Envoys {
					e := &s.Keys[i].Envoys[j]
					if cur, ok := latest[e.Node]; !ok || newer(e, cur) {
						latest[e.Node] = e
					}
				}
			}
		}
	}
	for _, s := range sums {
		for i := range s.Keys {
			ks := &s.Keys[i]
			rk := r.keys[ks.Key]
			if rk == nil {
				rk = &reportKey{}
				r.keys[ks.Key] = rk
				r.order = append(r.order, ks.Key)
			}
			rk.relays = append(rk.relays, ks)
			for _, tv := range ks.Types {
				rk.offer(tv.Type, refVersion{Version: tv.Version, origin: ks.Origin(), fresh: !ks.Stale})
			}
			rk.envoys = slices.Grow(rk.envoys, len(ks.Envoys))
			for j := range ks.Envoys {
				e := &ks.Envoys[j]
				if latest == nil || latest[e.Node] == e {
					rk.envoys = append(rk.envoys, reportEnvoy{state: e, from: ks})
				}
			}
		}
	}
	slices.Sort(r.order)
	for _, rk := range r.keys {
		for i := range rk.envoys {
			rk.envoys[i].behind = rk.behind(rk.envoys[i])
		}
	}
	return r
}

// offer makes v the key's reference version of typeURL if it is better
// than the one it has.
func (rk *reportKey) offer(typeURL string, v refVersion) {
	for i := range rk.reference {
		if rk.reference[i].typeURL == typeURL {
			if better(v, rk.reference[i].refVersion) {
				rk.reference[i].refVersion = v
			}
			return
		}
	}
	rk.reference = append(rk.reference, typeRef{typeURL: typeURL, refVersion: v})
}

// ref returns the key's reference version of typeURL.
func (rk *reportKey) ref(typeURL string) (refVersion, bool) {
	for _, r := range rk.reference {
		if r.typeURL == typeURL {
			return r.refVersion, true
		}
	}
	return refVersion{}, false
}

// better reports whether a is a better reference version than b: from a
// fresh origin first, then the latest received.
func better(a, b refVersion) bool {
	ra, rb := btoi(a.origin && a.fresh), btoi(b.origin && b.fresh)
	if ra != rb {
		return ra > rb
	}
	return a.Received.After(b.Received)
}

// newer reports whether Envoy state a is a later word on its node than b:
// connected beats disconnected, then the latest connection.
func newer(a, b *EnvoyState) bool {
	if a.Connected() != b.Connected() {
		return a.Connected()
	}
	return a.ConnectedAt.After(b.ConnectedAt)
}

// TypeOrder orders types as they are pushed: CDS, EDS, LDS, RDS, then the
// rest by name.
func TypeOrder(a, b string) int {
	return cmp.Or(cmp.Compare(typeRank(a), typeRank(b)), strings.Compare(a, b))
}

func typeRank(typeURL string) int {
	for i, suffix := range []string{".Cluster", ".ClusterLoadAssignment", ".Listener", ".RouteConfiguration"} {
		if strings.HasSuffix(typeURL, suffix) {
			return i
		}
	}
	return 4
}

// behind returns nil if e is on its key's reference version of every type
// it holds, or the Straggler that says why not.
func (rk *reportKey) behind(e reportEnvoy) *Straggler {
	st := e.state
	newStraggler := func() *Straggler { return &Straggler{Node: st.Node, Key: e.from.Key, Relay: e.from.Relay} }
	if !st.Connected() {
		s := newStraggler()
		s.Reason, s.Since = NotConnected, st.DisconnectedAt
		return s
	}
	if len(st.Types) == 0 {
		s := newStraggler()
		s.Reason, s.Since = NotSent, st.ConnectedAt
		if e.from.Stale {
			s.Reason = StaleSource
		}
		return s
	}
	for i := range st.Types {
		et := &st.Types[i]
		ref, ok := rk.ref(et.Type)
		if ok && et.Acked == ref.Root {
			continue
		}
		s := newStraggler()
		s.Type = et.Type
		switch {
		case et.NACK != nil:
			s.Reason, s.NACK, s.Since = NACKed, et.NACK, et.NACK.At
		case et.Pending:
			s.Reason, s.Since = NotACKed, et.SentAt
		case !ok || e.from.Stale || !holds(e.from, et.Type, ref.Root):
			s.Reason, s.Since = StaleSource, et.AckedAt
		default:
			s.Reason, s.Since = NotSent, et.AckedAt
		}
		if s.Since.IsZero() {
			s.Since = st.ConnectedAt
		}
		return s
	}
	return nil
}

// holds reports whether the relay's current version of typeURL is root.
func holds(ks *KeySummary, typeURL string, root Hash) bool {
	for _, tv := range ks.Types {
		if tv.Type == typeURL {
			return tv.Version.Root == root
		}
	}
	return false
}

// Convergence returns the share of every Envoy in the report on its key's
// current version.
func (r *Report) Convergence() Convergence {
	var c Convergence
	for _, rk := range r.keys {
		for _, e := range rk.envoys {
			c.add(e.behind == nil)
		}
	}
	return c
}

// ByKey returns the convergence of each key's Envoys.
func (r *Report) ByKey() map[string]Convergence {
	out := make(map[string]Convergence, len(r.keys))
	for name, rk := range r.keys {
		var c Convergence
		for _, e := range rk.envoys {
			c.add(e.behind == nil)
		}
		out[name] = c
	}
	return out
}

// ByRelay returns the convergence of the Envoys of each relay.
func (r *Report) ByRelay() map[string]Convergence {
	out := make(map[string]Convergence)
	for _, rk := range r.keys {
		for _, e := range rk.envoys {
			c := out[e.from.Relay]
			c.add(e.behind == nil)
			out[e.from.Relay] = c
		}
	}
	return out
}

// Stragglers lists the Envoys behind their key's current version, by key
// and node (at most limit; 0 means all).
func (r *Report) Stragglers(limit int) []Straggler {
	var out []Straggler
	for _, name := range r.order {
		first := len(out)
		for _, e := range r.keys[name].envoys {
			if s := e.behind; s != nil {
				out = append(out, *s)
			}
		}
		sortByNode(out[first:])
		if limit > 0 && len(out) >= limit {
			return out[:limit]
		}
	}
	return out
}

func sortByNode(ss []Straggler) {
	slices.SortFunc(ss, func(a, b Straggler) int { return strings.Compare(a.Node, b.Node) })
}

// Reference returns the key's current version of typeURL, as the report
// sees it.
func (r *Report) Reference(key, typeURL string) (Version, bool) {
	rk := r.keys[key]
	if rk == nil {
		return Version{}, false
	}
	v, ok := rk.ref(typeURL)
	return v.Version, ok
}

// Aggregation sums up how a tier's keys aggregate its Envoys: Envoys per
// key, and the keys that serve one Envoy (each costs the upstream a stream
// of its own). Add each key's Envoys; String says it.
type Aggregation struct{ Keys, Envoys, Lone int }

// Add counts a key of envoys Envoys.
func (a *Aggregation) Add(envoys int) {
	a.Keys++
	a.Envoys += envoys
	if envoys == 1 {
		a.Lone++
	}
}

func (a Aggregation) String() string {
	if a.Keys == 0 {
		return "no keys"
	}
	return fmt.Sprintf("%d keys, %d Envoys: %.1f Envoys a key; %d keys serve one Envoy", a.Keys, a.Envoys, float64(a.Envoys)/float64(a.Keys), a.Lone)
}

// KeyReport is the report's state of one key.
type KeyReport struct {
	Key string
	// Version is the key's ledger version: its reference roots combined.
	Version Hash
	// Convergence counts the key's Envoys (each once, where connected).
	Convergence Convergence
	// Holders are the summaries of the key by every relay that holds it.
	Holders []*KeySummary
}

// Keys returns the report's keys, by name.
func (r *Report) Keys() []KeyReport {
	out := make([]KeyReport, 0, len(r.order))
	for _, name := range r.order {
		rk := r.keys[name]
		kr := KeyReport{Key: name, Holders: rk.relays}
		pairs := make([]typeRoot, len(rk.reference))
		for i, ref := range rk.reference {
			pairs[i] = typeRoot{ref.typeURL, ref.Root}
		}
		kr.Version = combine(pairs)
		for _, e := range rk.envoys {
			kr.Convergence.add(e.behind == nil)
		}
		out = append(out, kr)
	}
	return out
}

// Connected returns how many of the summary's Envoys are connected.
func (k *KeySummary) Connected() int {
	n := 0
	for i := range k.Envoys {
		if k.Envoys[i].Connected() {
			n++
		}
	}
	return n
}

// EnvoyReport is the report's word on one Envoy (counted once, where it is
// connected).
type EnvoyReport struct {
	Key   string
	Relay string
	State *EnvoyState
	// Behind says why it is not on its key's current version (nil: it is).
	Behind *Straggler
}

// SyncStatus is an Envoy's state of one type in istioctl proxy-status's
// terms.
type SyncStatus string

const (
	StatusSynced       SyncStatus = "SYNCED"       // it ACKed its key's current view
	StatusNACKed       SyncStatus = "NACKED"       // it rejected the latest response
	StatusStale        SyncStatus = "STALE"        // sent, not answered yet
	StatusNotSent      SyncStatus = "NOT SENT"     // the current view has not been sent to it
	StatusDisconnected SyncStatus = "DISCONNECTED" // it left (listed a while)
)

// Status returns e's status of type et, against its key's current view of
// the type in the report (if the report knows it).
func (r *Report) Status(e EnvoyReport, et EnvoyType) SyncStatus {
	current, known := r.Reference(e.Key, et.Type)
	switch {
	case !e.State.Connected():
		return StatusDisconnected
	case et.NACK != nil:
		return StatusNACKed
	case et.Pending:
		return StatusStale
	case !et.Acked.IsZero() && (et.Acked == current.Root || !known && et.Acked == et.Sent):
		return StatusSynced
	}
	return StatusNotSent
}

// Envoys returns the report's Envoys, by key and node.
func (r *Report) Envoys() []EnvoyReport {
	var out []EnvoyReport
	for _, name := range r.order {
		first := len(out)
		for _, e := range r.keys[name].envoys {
			out = append(out, EnvoyReport{Key: name, Relay: e.from.Relay, State: e.state, Behind: e.behind})
		}
		slices.SortFunc(out[first:], func(a, b EnvoyReport) int { return strings.Compare(a.State.Node, b.State.Node) })
	}
	return out
}
