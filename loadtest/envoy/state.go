package envoy

import (
	"encoding/binary"
	"sort"
	"unique"

	"github.com/cespare/xxhash/v2"
	"google.golang.org/protobuf/types/known/anypb"
)

// name is an interned resource name: map keys hash a pointer instead of a
// string, and Envoys holding the same names share their bytes.
type name = unique.Handle[string]

const wildcardName = "*"

// kind is what the Envoy knows of a type.
type kind uint8

const (
	kindOther kind = iota
	kindCluster
	kindEndpoint
	kindListener
	kindRoute
)

func kindOf(typeURL string) kind {
	switch typeURL {
	case ClusterType:
		return kindCluster
	case EndpointType:
		return kindEndpoint
	case ListenerType:
		return kindListener
	case RouteType:
		return kindRoute
	default:
		return kindOther
	}
}

// requestOrder is the order in which types are (re)requested: Envoy's.
func (k kind) requestOrder() int {
	switch k {
	case kindCluster:
		return 0
	case kindEndpoint:
		return 1
	case kindListener:
		return 2
	case kindRoute:
		return 3
	default:
		return 4
	}
}

// fullState reports whether a SotW response of this kind is the full set
// (absent means removed). SotW EDS and RDS responses may carry only changes.
func (k kind) fullState() bool { return k == kindCluster || k == kindListener }

// entry is one held resource: an interned (version, body, hash,
// generation, references) tuple, so that Envoys holding the same resource share it and
// each pays only a map slot.
type entry = unique.Handle[heldValue]

type heldValue struct {
	version string
	body    string // the marshalled resource (anypb.Any value); "" in light mode
	hash    uint64 // contentHash of the body, kept in both modes
	gen     uint64 // what Config.Generation returned for it (0 if unset)
	// refs encodes the names this resource makes the Envoy subscribe to (a
	// cluster's EDS service name, a listener's route_config_names) and the
	// clusters it uses directly (routes; listeners' tcp_proxy and inline
	// route configs), which must be held first. See encodeRefs.
	refs string
}

func (ts *typeState) export(en entry) Held {
	v := en.Value()
	h := Held{Version: v.version, Hash: v.hash, Generation: v.gen}
	if !ts.light {
		h.Resource = &anypb.Any{TypeUrl: ts.url, Value: []byte(v.body)}
	}
	return h
}

// contentHash is Held.Hash of a resource's bytes: xxhash64, fast enough
// to run over every byte a fleet receives.
func contentHash(b []byte) uint64 { return xxhash.Sum64(b) }

// encodeRefs encodes deps then uses, each a uvarint count followed by
// uvarint-length-prefixed names.
func encodeRefs(deps, uses []string) string {
	if len(deps) == 0 && len(uses) == 0 {
		return ""
	}
	var b []byte
	for _, list := range [][]string{deps, uses} {
		b = binary.AppendUvarint(b, uint64(len(list)))
		for _, s := range list {
			b = binary.AppendUvarint(b, uint64(len(s)))
			b = append(b, s...)
		}
	}
	return string(b)
}

// eachRef calls f for every name encoded by encodeRefs (dep: it is a deps
// name, else a uses name), without allocating.
func eachRef(enc string, f func(dep bool, s string)) {
	for list := 0; list < 2 && enc != ""; list++ {
		var count uint64
		count, enc = uvarint(enc)
		for ; count > 0 && enc != ""; count-- {
			var n uint64
			n, enc = uvarint(enc)
			n = min(n, uint64(len(enc)))
			f(list == 0, enc[:n])
			enc = enc[n:]
		}
	}
}

func uvarint(s string) (uint64, string) {
	var x uint64
	for i := 0; i < len(s) && i < binary.MaxVarintLen64; i++ {
		b := s[i]
		x |= uint64(b&0x7f) << (7 * i)
		if b < 0x80 {
			return x, s[i+1:]
		}
	}
	return x, ""
}

// typeState is everything the Envoy holds and wants for one type URL. It is
// guarded by Envoy.mu.
type typeState struct {
	url      string
	kind     kind
	light    bool // Config.Light: held bodies are dropped
	wildcard bool
	// subs is the current subscription (derived from CDS/LDS, plus user).
	// It is also what the server was last told, since the stream goroutine
	// sends every change before it reads the next response.
	subs map[name]struct{}
	// sorted caches sortedNames(subs): a SotW Envoy repeats its whole
	// subscription in every ACK; nil after subs changes.
	sorted []string
	// user holds the names added by Subscribe, kept across CDS/LDS changes.
	user map[name]struct{}
	// addQ and delQ are Delta subscription changes not yet sent.
	addQ, delQ map[name]struct{}
	// linger holds names unsubscribed recently: -1 until the request is
	// sent, then how many more responses may still carry them.
	linger map[name]int
	held   map[name]entry
	// gens is the highest generation seen per name (only with
	// Config.Generation); what is held has its own in its entry.
	gens map[name]uint64
	// acked is the version of the last ACKed response.
	acked string

	// Per stream.
	nonce    string // last nonce received for this type
	opened   bool   // a request for this type went out on this stream
	starSent bool   // "*" is said explicitly on this stream
	dirty    bool   // a request must be sent
}

// typeLocked returns the state of typeURL, creating it.
func (e *Envoy) typeLocked(typeURL string) *typeState {
	if ts := e.types[typeURL]; ts != nil {
		return ts
	}
	ts := &typeState{
		url:   typeURL,
		kind:  kindOf(typeURL),
		light: e.cfg.Light,
		subs:  make(map[name]struct{}),
		held:  make(map[name]entry),
	}
	e.types[typeURL] = ts
	e.order = append(e.order, ts)
	sort.SliceStable(e.order, func(i, j int) bool {
		a, b := e.order[i], e.order[j]
		if a.kind.requestOrder() != b.kind.requestOrder() {
			return a.kind.requestOrder() < b.kind.requestOrder()
		}
		return a.url < b.url
	})
	return ts
}

// wanted reports whether the type has anything to ask for.
func (ts *typeState) wanted() bool { return ts.wildcard || len(ts.subs) > 0 }

// subscribeLocked adds n to the subscription; it reports whether it is new.
func (ts *typeState) subscribeLocked(n name) bool {
	delete(ts.linger, n)
	if _, ok := ts.subs[n]; ok {
		return false
	}
	ts.subs[n] = struct{}{}
	ts.sorted = nil
	return true
}

// unsubscribeLocked removes n from the subscription and drops what is held
// under it; it reports whether a resource was dropped.
func (ts *typeState) unsubscribeLocked(n name, grace int) bool {
	if _, ok := ts.subs[n]; ok {
		delete(ts.subs, n)
		ts.sorted = nil
		if grace > 0 {
			if ts.linger == nil {
				ts.linger = make(map[name]int)
			}
			ts.linger[n] = -grace
		}
	}
	if _, ok := ts.held[n]; ok && !ts.wildcard {
		delete(ts.held, n)
		return true
	}
	return false
}

// queue records a Delta subscription change to send.
func (ts *typeState) queue(n name, subscribe bool) {
	add, del := &ts.addQ, &ts.delQ
	if !subscribe {
		add, del = del, add
	}
	if *add == nil {
		*add = make(map[name]struct{})
	}
	(*add)[n] = struct{}{}
	delete(*del, n)
}

// sent arms the lingering names once a request carrying their removal went
// out.
func (ts *typeState) sent() {
	ts.opened = true
	ts.dirty = false
	for n, v := range ts.linger {
		if v < 0 {
			ts.linger[n] = -v
		}
	}
}

// responded counts one response against the lingering names.
func (ts *typeState) responded() {
	for n, v := range ts.linger {
		switch {
		case v == 1:
			delete(ts.linger, n)
		case v > 1:
			ts.linger[n] = v - 1
		}
	}
}

// allowed reports whether a resource named n may arrive.
func (ts *typeState) allowed(n name) bool {
	if ts.wildcard {
		return true
	}
	if _, ok := ts.subs[n]; ok {
		return true
	}
	_, ok := ts.linger[n]
	return ok
}

// requestNames is the SotW resource_names (and Delta's initial subscribe).
func (ts *typeState) requestNames() []string {
	if ts.sorted == nil {
		ts.sorted = sortedNames(ts.subs)
	}
	names := ts.sorted
	if ts.wildcard && (len(names) > 0 || ts.starSent) {
		ts.starSent = true
		names = append([]string{wildcardName}, names...)
	}
	return names
}

// resetStream forgets what belonged to the previous stream.
func (ts *typeState) resetStream() {
	ts.nonce = ""
	ts.opened = false
	ts.starSent = false
	ts.addQ, ts.delQ = nil, nil
	ts.linger = nil
	ts.dirty = ts.wanted()
}
