package ledger

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// TrackerConfig configures a Tracker.
type TrackerConfig struct {
	// Relay names this relay in answers (Straggler.Relay, Summary.Relay).
	Relay string
	// ForgetAfter is how long an Envoy whose stream ended is still listed,
	// as not connected, unless it connects again. Default 30 s: longer
	// than an Envoy takes to reconnect with backoff, so an Envoy in
	// transit between relays is a straggler, and one that is gone (its pod
	// deleted) stops counting soon after.
	ForgetAfter time.Duration
	// MaxDetail is how many bytes of a NACK's error_detail are kept.
	// Default 1024.
	MaxDetail int
	// Converged, if set, observes the time from a version's receipt from
	// upstream to an Envoy's ACK of it, once per Envoy, type and version.
	// It is called on the goroutine that reports the ACK, holding no lock.
	Converged func(typeURL string, d time.Duration)
}

// DefaultTrackerConfig returns the defaults.
func DefaultTrackerConfig() TrackerConfig {
	return TrackerConfig{ForgetAfter: 30 * time.Second, MaxDetail: 1024}
}

// Views is what the Tracker needs of one key's versions of one type: a
// *History.
type Views interface {
	Current() Version
	Lookup(root Hash) (Version, bool)
	FirstWith(name string, hash Hash) (uint64, bool)
	Prove(root Hash, name string) (Proof, error)
}

var _ Views = (*History[int])(nil)

// Tracker is one relay's ledger of its Envoys: for each Envoy and type, the
// version it was sent, the one it ACKed and its latest NACK, against its
// key's versions; and the answers built on them (convergence, stragglers,
// delivery of a resource, wait).
//
// Envoys are tracked through the *Envoy handle Connect returns. A Tracker
// is safe for concurrent use; each Envoy's handle is used by one goroutine
// (its stream's) while queries run on any.
type Tracker struct {
	cfg TrackerConfig

	mu    sync.RWMutex
	keys  map[string]*keyEntry
	nodes map[string]*Envoy // the latest Envoy handle of each node id

	nacks nackTable
	// lastSweep is when every key was last swept (Unix nanoseconds).
	lastSweep atomic.Int64

	// changed is closed and replaced on every change while waiters > 0.
	waiters   atomic.Int32
	changedMu sync.Mutex
	changed   chan struct{}
}

// keyEntry is the Tracker's state of one aggregation key. mu guards
// everything below it and every Envoy's types.
type keyEntry struct {
	key string

	mu     sync.Mutex
	types  map[string]*typeEntry
	source Source
	stale  bool
	splits []string
	// idle is set once the relay dropped the key while Envoys of it were
	// still listed: the entry goes when they do. dropped is set once the
	// entry left Tracker.keys: whoever still holds it looks the key up
	// again.
	idle, dropped bool
	envoys        []*Envoy // a slice, not a map: queries walk it (Envoy.idx is the place)
	// connected counts the connected Envoys, current those of them on the
	// key's current version (kept as Envoys and versions change, so that
	// Convergence reads counters, not every Envoy); gone holds the
	// disconnected ones not forgotten yet.
	connected, current int
	gone               map[*Envoy]struct{}
	// typeSets holds the sets of types the key's Envoys hold (each in
	// push order, as Envoy.types), at most maxTypeSets: a Brief summary
	// gives a settled Envoy by the index of its set (Envoy.typeSet).
	typeSets [][]string
}

// maxTypeSets bounds keyEntry.typeSets; an Envoy of a set past it is given
// in full.
const maxTypeSets = 64

type typeEntry struct {
	views   Views
	current Version
}

// Envoy is the Tracker's handle on one Envoy stream. Its methods are called
// by the stream's goroutine; Disconnect ends it. A nil *Envoy records
// nothing (a relay does not track other relays' streams).
type Envoy struct {
	t    *Tracker
	k    *keyEntry
	node string
	meta NodeMeta // guarded by k.mu (SetMeta)

	// Guarded by k.mu. A forgotten handle (its node connected again, or it
	// was disconnected past ForgetAfter) records nothing more. current is
	// set while it is connected and on its key's current version.
	forgotten bool
	current   bool
	// settled is set while current and nothing is pending, NACKed, or sent
	// but not ACKed; typeSet is the index of the Envoy's types in
	// k.typeSets (-1: past maxTypeSets). Both are kept as the Envoy
	// changes, so that a Brief summary reads them without walking types.
	settled        bool
	typeSet        int
	connectedAt    time.Time
	disconnectedAt time.Time   // zero while connected
	types          []envoyType // in push order (TypeOrder), held in place: queries walk them
	idx            int         // in k.envoys, while not forgotten
}

type envoyType struct {
	typeURL string
	// sentView is the view the Envoy holds all it should of once it
	// applies what it was sent (zero: not known yet); pending is set while
	// its latest response is unanswered.
	sentView Hash
	sentAt   time.Time
	pending  bool
	// ackedView is the latest view the Envoy ACKed all it should of.
	ackedView Hash
	ackedAt   time.Time
	// nack is the latest NACK, cleared by a later ACK.
	nack *nackState
}

type nackState struct {
	row     *nackRow
	version string
	detail  string
	at      time.Time
}

// NewTracker returns an empty Tracker.
func NewTracker(cfg TrackerConfig) (*Tracker, error) {
	if cfg.ForgetAfter <= 0 {
		return nil, fmt.Errorf("ledger: ForgetAfter %v, want > 0", cfg.ForgetAfter)
	}
	if cfg.MaxDetail <= 0 {
		return nil, fmt.Errorf("ledger: MaxDetail %d, want > 0", cfg.MaxDetail)
	}
	return &Tracker{
		cfg:     cfg,
		keys:    make(map[string]*keyEntry),
		nodes:   make(map[string]*Envoy),
		nacks:   nackTable{rows: make(map[Fingerprint]*nackRow)},
		changed: make(chan struct{}),
	}, nil
}

// keyEntry returns the entry of key, creating it.
func (t *Tracker) keyEntry(key string) *keyEntry {
	t.mu.RLock()
	k := t.keys[key]
	t.mu.RUnlock()
	if k != nil {
		return k
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if k = t.keys[key]; k == nil {
		k = &keyEntry{key: key, types: make(map[string]*typeEntry), gone: make(map[*Envoy]struct{})}
		t.keys[key] = k
	}
	return k
}

// lockKey returns the entry of key, creating it, with its lock held.
func (t *Tracker) lockKey(key string) *keyEntry {
	for {
		k := t.keyEntry(key)
		k.mu.Lock()
		if !k.dropped {
			return k
		}
		k.mu.Unlock() // dropped meanwhile: look it up again
	}
}

// Recorded tells the Tracker that key's view of typeURL is now v, out of
// views (the History that recorded it).
func (t *Tracker) Recorded(key, typeURL string, views Views, v Version) {
	k := t.lockKey(key)
	k.idle = false
	te := k.types[typeURL]
	if te == nil {
		te = &typeEntry{}
		k.types[typeURL] = te
	}
	te.views, te.current = views, v
	k.refreshAllLocked()
	k.mu.Unlock()
	t.notify()
}

// refreshAllLocked recounts the key's current Envoys after its versions
// changed. The caller holds k.mu.
func (k *keyEntry) refreshAllLocked() {
	for _, e := range k.envoys {
		k.refreshLocked(e)
	}
}

// refreshLocked updates e.current and the key's count after a change to e.
// The caller holds k.mu.
func (k *keyEntry) refreshLocked(e *Envoy) {
	cur := !e.forgotten && e.disconnectedAt.IsZero() && k.currentLocked(e)
	e.settled = cur && e.quietLocked()
	if cur != e.current {
		e.current = cur
		if cur {
			k.current++
		} else {
			k.current--
		}
	}
}

// SetSource says where key's views come from (an origin's are the key's
// reference for the tier), and whether no live source confirms them.
func (t *Tracker) SetSource(key string, src Source, stale bool) {
	k := t.lockKey(key)
	changed := k.stale != stale || k.source != src
	k.source, k.stale = src, stale
	k.mu.Unlock()
	if changed {
		t.notify()
	}
}

// SetSplits records the descriptions of key's splits (KeySummary.Splits).
func (t *Tracker) SetSplits(key string, splits []string) {
	k := t.lockKey(key)
	changed := !slices.Equal(k.splits, splits)
	if changed {
		k.splits = slices.Clone(splits)
	}
	k.mu.Unlock()
	if changed {
		t.notify()
	}
}

// DropKey forgets key's versions once the relay no longer holds it. Envoys
// of the key stay listed until forgotten; the key goes with the last. The
// caller must not record views of the key it dropped, nor let a new holder
// of the key record before it returns (the relay calls it holding the lock
// under which it creates keys).
func (t *Tracker) DropKey(key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	k := t.keys[key]
	if k == nil {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.envoys) == 0 {
		delete(t.keys, key)
		k.dropped = true
		return
	}
	k.types = make(map[string]*typeEntry)
	k.idle = true
	k.refreshAllLocked()
}

// Connect starts tracking a stream of node, an Envoy of key. A node
// connected again (here, after its earlier stream ended or while it lingers)
// is the new stream from then on.
func (t *Tracker) Connect(node, key string, at time.Time) *Envoy {
	k := t.lockKey(key)
	e := &Envoy{t: t, k: k, node: node, connectedAt: at, typeSet: -1}
	e.idx = len(k.envoys)
	k.envoys = append(k.envoys, e)
	k.connected++
	k.idle = false
	k.mu.Unlock()
	t.mu.Lock()
	old := t.nodes[node]
	t.nodes[node] = e
	t.mu.Unlock()
	if old != nil {
		old.forget()
	}
	t.sweep(k, at)
	t.notify()
	return e
}

// SetMeta records what admin tools show of the Envoy's node.
func (e *Envoy) SetMeta(m NodeMeta) {
	e.k.mu.Lock()
	e.meta = m
	e.k.mu.Unlock()
}

// forget removes e from its key (and its NACK from the counts).
func (e *Envoy) forget() {
	e.k.mu.Lock()
	if !e.forgotten {
		e.forgotten = true
		e.k.refreshLocked(e)
		e.k.remove(e)
		delete(e.k.gone, e)
		if e.disconnectedAt.IsZero() {
			e.k.connected--
		}
		for i := range e.types {
			if n := e.types[i].nack; n != nil {
				e.t.nacks.release(n.row)
			}
		}
	}
	last := e.k.idle && len(e.k.envoys) == 0
	e.k.mu.Unlock()
	if last {
		e.t.dropIdle(e.k)
	}
}

// dropIdle removes k, which the relay dropped, once its last Envoy is
// forgotten.
func (t *Tracker) dropIdle(k *keyEntry) {
	t.mu.Lock()
	defer t.mu.Unlock()
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.idle && len(k.envoys) == 0 && t.keys[k.key] == k {
		delete(t.keys, k.key)
		k.dropped = true
	}
}

// Disconnect records that the Envoy's stream ended. It is listed as not
// connected until ForgetAfter passes or the node connects again.
func (e *Envoy) Disconnect(at time.Time) {
	if e == nil {
		return
	}
	e.k.mu.Lock()
	if e.disconnectedAt.IsZero() && !e.forgotten {
		e.disconnectedAt = at
		e.k.connected--
		e.k.gone[e] = struct{}{}
		e.k.refreshLocked(e)
	}
	e.k.mu.Unlock()
	e.t.sweep(e.k, at)
	e.t.notify()
}

// Subscribe records that the Envoy subscribed to typeURL: until it is
// synced, it is not on its key's current version.
func (e *Envoy) Subscribe(typeURL string) {
	if e == nil {
		return
	}
	e.k.mu.Lock()
	if !e.forgotten {
		e.typeLocked(typeURL)
		e.k.refreshLocked(e)
	}
	e.k.mu.Unlock()
}

// Sent records a response of typeURL sent to the Envoy at at.
func (e *Envoy) Sent(typeURL string, at time.Time) {
	if e == nil {
		return
	}
	e.k.mu.Lock()
	if !e.forgotten {
		et := e.typeLocked(typeURL)
		et.sentView, et.sentAt, et.pending = Hash{}, at, true
		e.k.refreshLocked(e)
	}
	e.k.mu.Unlock()
}

// Synced records that, once it applies what it was sent, the Envoy holds
// all it should of view (the root of its key's view of typeURL). If nothing
// is awaiting an answer, it holds it already.
func (e *Envoy) Synced(typeURL string, view Hash, at time.Time) {
	if e == nil {
		return
	}
	e.k.mu.Lock()
	if e.forgotten {
		e.k.mu.Unlock()
		return
	}
	et := e.typeLocked(typeURL)
	et.sentView = view
	changed := false
	if !et.pending && et.nack == nil && et.ackedView != view {
		et.ackedView, et.ackedAt, changed = view, at, true
		e.k.refreshLocked(e)
	}
	e.k.mu.Unlock()
	if changed {
		e.t.notify()
	}
}

// Answer is an Envoy's answer to a response of one type.
type Answer struct {
	// Version is the version of the response answered.
	Version string
	// Detail is a NACK's error_detail; "" for an ACK.
	Detail string
	// Latest is set if it answers the latest response sent of the type.
	Latest bool
	// Rejecting is set on an ACK while content the Envoy rejected earlier
	// has not been sent to it again: the ACK keeps the NACK, and the Envoy
	// is not on the version (a relay does not send rejected content again
	// until it changes, so a later response may carry other names only).
	Rejecting bool
	At        time.Time
}

// Answered records the Envoy's ACK or NACK of a response of typeURL.
func (e *Envoy) Answered(typeURL string, a Answer) {
	if e == nil {
		return
	}
	detail, latest, at := a.Detail, a.Latest, a.At
	var converged time.Duration
	var observe bool
	e.k.mu.Lock()
	if e.forgotten {
		e.k.mu.Unlock()
		return
	}
	et := e.typeLocked(typeURL)
	if latest {
		et.pending = false
	}
	if detail != "" {
		if len(detail) > e.t.cfg.MaxDetail {
			detail = detail[:e.t.cfg.MaxDetail]
		}
		row := e.t.nacks.acquire(typeURL, detail, at)
		if et.nack != nil {
			e.t.nacks.release(et.nack.row)
		}
		et.nack = &nackState{row: row, version: a.Version, detail: detail, at: at}
	} else if latest && !a.Rejecting {
		if et.nack != nil {
			e.t.nacks.release(et.nack.row)
			et.nack = nil
		}
		if v := et.sentView; !v.IsZero() && v != et.ackedView {
			et.ackedView, et.ackedAt = v, at
			if te := e.k.types[typeURL]; te != nil && e.t.cfg.Converged != nil {
				if te.current.Root == v {
					converged, observe = at.Sub(te.current.Received), true
				} else if ver, ok := te.views.Lookup(v); ok {
					converged, observe = at.Sub(ver.Received), true
				}
			}
		}
	}
	e.k.refreshLocked(e)
	e.k.mu.Unlock()
	if observe {
		e.t.cfg.Converged(typeURL, converged)
	}
	e.t.notify()
}

// typeLocked returns the Envoy's state of typeURL, creating it. The caller
// holds e.k.mu.
// The pointer is valid until the next typeLocked.
func (e *Envoy) typeLocked(typeURL string) *envoyType {
	for i := range e.types { // a handful: a scan beats a search
		if e.types[i].typeURL == typeURL {
			return &e.types[i]
		}
	}
	i, _ := slices.BinarySearchFunc(e.types, typeURL, func(et envoyType, u string) int { return TypeOrder(et.typeURL, u) })
	e.types = slices.Insert(e.types, i, envoyType{typeURL: typeURL})
	e.typeSet = e.k.typeSetLocked(e)
	return &e.types[i]
}

// remove takes e out of k.envoys. The caller holds k.mu.
func (k *keyEntry) remove(e *Envoy) {
	last := len(k.envoys) - 1
	k.envoys[e.idx] = k.envoys[last]
	k.envoys[e.idx].idx = e.idx
	k.envoys[last] = nil
	k.envoys = k.envoys[:last]
}

// notify wakes waiters, if any.
func (t *Tracker) notify() {
	if t.waiters.Load() == 0 {
		return
	}
	t.changedMu.Lock()
	close(t.changed)
	t.changed = make(chan struct{})
	t.changedMu.Unlock()
}

func (t *Tracker) watch() <-chan struct{} {
	t.changedMu.Lock()
	defer t.changedMu.Unlock()
	return t.changed
}

// Scope selects the Envoys a query is about. The zero Scope is every Envoy.
type Scope struct {
	// Key, if set, selects the Envoys of that aggregation key.
	Key string
	// KeyPrefix, if set, selects the Envoys of keys that start with it
	// (with the Istio profile, "sidecar/<namespace>/" is a namespace).
	KeyPrefix string
}

func (s Scope) has(key string) bool {
	return (s.Key == "" || key == s.Key) && strings.HasPrefix(key, s.KeyPrefix)
}

// ErrBadShare is returned by Wait for a target share outside (0, 1].
var ErrBadShare = errors.New("ledger: target share must be in (0, 1]")

// Wait returns when the share of the scope's Envoys on their key's current
// version reaches share, with the convergence then, or when ctx ends, with
// the convergence and stragglers then and ctx's error.
func (t *Tracker) Wait(ctx context.Context, scope Scope, share float64) (Convergence, []Straggler, error) {
	if !(share > 0 && share <= 1) {
		return Convergence{}, nil, ErrBadShare
	}
	t.waiters.Add(1)
	defer t.waiters.Add(-1)
	for {
		ch := t.watch()
		now := time.Now()
		s := t.Summary(scope, now, Brief)
		c := s.Convergence()
		if c.Share() >= share {
			return c, nil, nil
		}
		// An Envoy that left counts until forgotten, which nothing
		// announces: wake then too.
		var next <-chan time.Time
		var tm *time.Timer
		if at, ok := s.nextForget(t.cfg.ForgetAfter); ok {
			tm = time.NewTimer(at.Sub(now) + time.Millisecond)
			next = tm.C
		}
		select {
		case <-ch:
		case <-next:
		case <-ctx.Done():
			return c, s.Stragglers(0), ctx.Err()
		}
		if tm != nil {
			tm.Stop()
		}
	}
}

// Summary returns the Tracker's state of the scope's keys and Envoys at
// now, in detail d: what every query is answered from, on one relay or,
// merged with Merge, across the tier.
func (t *Tracker) Summary(scope Scope, now time.Time, d Detail) *Summary {
	keys := t.keysIn(scope)
	slices.SortFunc(keys, func(a, b *keyEntry) int { return strings.Compare(a.key, b.key) })
	s := &Summary{Relay: t.cfg.Relay, At: now, Keys: make([]KeySummary, 0, len(keys))}
	var forgotten []*Envoy
	for _, k := range keys {
		var ks KeySummary
		ks, forgotten = k.summary(t.cfg.Relay, now, t.cfg.ForgetAfter, d, forgotten)
		s.Keys = append(s.Keys, ks)
	}
	t.forgetAll(forgotten)
	return s
}

// forgetAll forgets Envoys disconnected past ForgetAfter.
func (t *Tracker) forgetAll(es []*Envoy) {
	if len(es) == 0 {
		return
	}
	t.mu.Lock()
	for _, e := range es {
		if t.nodes[e.node] == e {
			delete(t.nodes, e.node)
		}
	}
	t.mu.Unlock()
	for _, e := range es {
		e.forget()
	}
	t.notify() // the shares changed: a Wait may be done
}

// expiredLocked appends to out the Envoys of k disconnected past
// ForgetAfter at now. The caller holds k.mu.
func (t *Tracker) expiredLocked(k *keyEntry, now time.Time, out []*Envoy) []*Envoy {
	for e := range k.gone {
		if now.Sub(e.disconnectedAt) > t.cfg.ForgetAfter {
			out = append(out, e)
		}
	}
	return out
}

// sweep forgets the Envoys disconnected past ForgetAfter: those of k, and
// of every key if the last sweep of every key is ForgetAfter/2 old. Queries
// forget them too, but memory must not wait for a query: under churn (pods
// replaced) every stream that ends would stay.
func (t *Tracker) sweep(k *keyEntry, now time.Time) {
	var expired []*Envoy
	keys := []*keyEntry{k}
	if last := t.lastSweep.Load(); now.UnixNano()-last > int64(t.cfg.ForgetAfter/2) && t.lastSweep.CompareAndSwap(last, now.UnixNano()) {
		keys = t.keysIn(Scope{})
	}
	for _, k := range keys {
		k.mu.Lock()
		expired = t.expiredLocked(k, now, expired)
		k.mu.Unlock()
	}
	t.forgetAll(expired)
}

// summary is the KeySummary of k; Envoys disconnected for longer than
// forgetAfter are left out and appended to forgotten.
func (k *keyEntry) summary(relay string, now time.Time, forgetAfter time.Duration, d Detail, forgotten []*Envoy) (KeySummary, []*Envoy) {
	k.mu.Lock()
	defer k.mu.Unlock()
	ks := KeySummary{Key: k.key, Relay: relay, Source: k.source, Stale: k.stale, Splits: k.splits, Types: make([]TypeVersion, 0, len(k.types)), Envoys: make([]EnvoyState, 0, len(k.envoys))}
	for typeURL, te := range k.types {
		ks.Types = append(ks.Types, TypeVersion{Type: typeURL, Version: te.current})
	}
	slices.SortFunc(ks.Types, func(a, b TypeVersion) int { return strings.Compare(a.Type, b.Type) })
	// One array for every Envoy's types: one allocation, not one each.
	var buf []EnvoyType
	if d == Full {
		buf = make([]EnvoyType, 0, len(k.envoys)*max(1, len(k.types)))
	}
	// brief holds, in Brief, the Types the settled Envoys share: one slice
	// per set of types (nearly always one per key), built when first met.
	var brief [][]EnvoyType
	if d == Brief {
		brief = make([][]EnvoyType, len(k.typeSets))
	}
	for _, e := range k.envoys {
		if !e.disconnectedAt.IsZero() && now.Sub(e.disconnectedAt) > forgetAfter {
			forgotten = append(forgotten, e)
			continue
		}
		es := EnvoyState{Node: e.node, Meta: e.meta, ConnectedAt: e.connectedAt, DisconnectedAt: e.disconnectedAt}
		if d == Brief && e.settled && e.typeSet >= 0 {
			es.Types = k.briefTypes(e.typeSet, brief)
			ks.Envoys = append(ks.Envoys, es)
			continue
		}
		first := len(buf)
		for i := range e.types {
			et := &e.types[i]
			x := EnvoyType{Type: et.typeURL, Sent: et.sentView, SentAt: et.sentAt, Pending: et.pending, Acked: et.ackedView, AckedAt: et.ackedAt}
			if n := et.nack; n != nil {
				x.NACK = &NACKState{Fingerprint: n.row.fp, Version: n.version, Detail: n.detail, At: n.at}
			}
			buf = append(buf, x)
		}
		es.Types = buf[first:len(buf):len(buf)]
		ks.Envoys = append(ks.Envoys, es)
	}
	return ks, forgotten
}

// quietLocked reports whether e has nothing in flight: no response
// pending, no NACK, nothing sent it has not ACKed. With e.current, a Brief
// summary may give e in brief (e.settled). The caller holds e.k.mu.
func (e *Envoy) quietLocked() bool {
	for i := range e.types {
		et := &e.types[i]
		if et.pending || et.nack != nil || et.sentView != et.ackedView {
			return false
		}
	}
	return true
}

// briefTypes returns the Types of a settled Envoy of type set i, out of
// shared (the slices built so far for this summary, by set), building it
// from the key's current roots. The caller holds k.mu.
func (k *keyEntry) briefTypes(i int, shared [][]EnvoyType) []EnvoyType {
	if shared[i] == nil {
		urls := k.typeSets[i]
		ts := make([]EnvoyType, len(urls))
		for j, u := range urls {
			root := k.types[u].current.Root // settled: every type is the key's
			ts[j] = EnvoyType{Type: u, Sent: root, Acked: root}
		}
		shared[i] = ts
	}
	return shared[i]
}

// typeSetLocked returns the index of e's types in k.typeSets, adding
// them (-1 past maxTypeSets). The caller holds k.mu.
func (k *keyEntry) typeSetLocked(e *Envoy) int {
next:
	for i, urls := range k.typeSets {
		if len(urls) != len(e.types) {
			continue
		}
		for j := range urls {
			if urls[j] != e.types[j].typeURL {
				continue next
			}
		}
		return i
	}
	if len(k.typeSets) >= maxTypeSets {
		return -1
	}
	urls := make([]string, len(e.types))
	for j := range e.types {
		urls[j] = e.types[j].typeURL
	}
	k.typeSets = append(k.typeSets, urls)
	return len(k.typeSets) - 1
}

// keysIn returns the entries of the scope's keys.
func (t *Tracker) keysIn(scope Scope) []*keyEntry {
	t.mu.RLock()
	defer t.mu.RUnlock()
	keys := make([]*keyEntry, 0, len(t.keys))
	for name, k := range t.keys {
		if scope.has(name) {
			keys = append(keys, k)
		}
	}
	return keys
}

// NACKs returns the NACKs Envoys hold now, one row per fingerprint, most
// frequent first.
func (t *Tracker) NACKs() []NACKRow { return t.nacks.snapshot() }

// Convergence returns the share of the scope's Envoys on their key's
// current version on this relay. It is Summary(scope, now, Brief).Convergence()
// without building the summary: the query an operator polls.
func (t *Tracker) Convergence(scope Scope, now time.Time) Convergence {
	keys := t.keysIn(scope)
	var c Convergence
	for _, k := range keys {
		k.mu.Lock()
		c.Envoys += k.connected
		c.Current += k.current
		for e := range k.gone {
			if now.Sub(e.disconnectedAt) <= t.cfg.ForgetAfter {
				c.Envoys++
			}
		}
		k.mu.Unlock()
	}
	return c
}

// currentLocked reports whether the connected Envoy e is on k's current
// version of every type it subscribes to. The caller holds k.mu.
func (k *keyEntry) currentLocked(e *Envoy) bool {
	if len(e.types) == 0 {
		return false
	}
	for i := range e.types {
		et := &e.types[i]
		te := k.types[et.typeURL]
		if te == nil || et.ackedView != te.current.Root {
			return false
		}
	}
	return true
}
